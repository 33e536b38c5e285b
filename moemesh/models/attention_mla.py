"""Multi-head latent attention (DeepSeek V2/V3), as transformers computes it.

Queries come from a low-rank latent (q_a_proj -> RMSNorm -> q_b_proj) or, without q_lora_rank
(V2-Lite), from one q_proj. Keys and values come from a shared latent of kv_lora_rank
(kv_a_proj_with_mqa, RMSNorm, kv_b_proj expands it per head) plus one rotary key part of
qk_rope_head_dim shared by all heads. Each head's query/key is [nope | rope], only the rope part
rotated. With rope_interleave the rope dims come in (even, odd) pairs: V3 de-interleaves them
before rotating, V2 rotates them as complex pairs in place; both give the same q·k, so one
de-interleave serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.config import ModelConfig
from moemesh.models.layers import KVCache, RMSNorm, apply_rotary, attention_mask, grouped_attention
from moemesh.models.rope import softmax_scale
from moemesh.ops.linear import Linear


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.interleave = config.rope_interleave
        hidden, bias, qk_dim = config.hidden_size, config.attention_bias, self.nope + self.rope
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if config.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, 1e-6)  # transformers' default eps here
            self.q_b_proj = Linear(config.q_lora_rank, self.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(qk_dim, config.rope_scaling, config.max_position_embeddings)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleave:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return apply_rotary(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)  # [B, h, T, nope + rope]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)

        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)

        cos, sin = rope
        q_rot = self._rotate(q_rot, cos, sin)
        k_rot = self._rotate(k_rot[:, None], cos, sin).expand(-1, k_nope.shape[1], -1, -1)  # one for all heads
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot], dim=-1)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, positions)
            out = grouped_attention(q, k, v, attention_mask(positions, k.shape[2], None), self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
