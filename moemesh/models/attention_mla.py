"""Multi-head latent attention (DeepSeek V2/V3), as transformers computes it.

Queries come from a low-rank latent (q_a_proj -> RMSNorm -> q_b_proj) or, without q_lora_rank
(V2-Lite), from one q_proj. Keys and values come from a shared latent of kv_lora_rank
(kv_a_proj_with_mqa, RMSNorm, kv_b_proj expands it per head) plus one rotary key part of
qk_rope_head_dim shared by all heads. Each head's query/key is [nope | rope], only the rope part
rotated. With rope_interleave the rope dims come in (even, odd) pairs: V3 de-interleaves them
before rotating, V2 rotates them as complex pairs in place; both give the same q·k, so one
de-interleave serves both.

With a KV cache the layer caches what every head's key and value come from: the normalised latent
and the rotated shared key, kv_lora_rank + qk_rope_head_dim numbers a token (576 for V3, against
128 heads × (192 + 128) expanded). Attention then runs on the latent ("absorbed", as DeepSeek
serves it): each head's query part without rotary is taken through its slice of kv_b_proj's key
half into the latent space, the scores are q_latent·latent + q_rope·k_rope — the same sums as
q_nope·k_nope + q_rope·k_rope in another order — one key/value "head" shared by all query heads,
and the output (probabilities · latent) goes through the value half of kv_b_proj per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.config import ModelConfig
from moemesh.models.layers import PagedKVCache, RMSNorm, paged_attention
from moemesh.models.rope import softmax_scale
from moemesh.ops import documents
from moemesh.ops.linear import Linear
from moemesh.ops.rotary import rotary


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
        return rotary(x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: PagedKVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)  # [B, h, T, nope + rope]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)

        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = rope
        q_rot = self._rotate(q_rot, cos, sin)
        k_rot = self._rotate(k_rot[:, None], cos, sin)  # [B, 1, T, rope]: one for all heads
        if cache is not None:
            return self._absorbed(q_nope, q_rot, latent, k_rot, cache)
        kv = self.kv_b_proj(latent).view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        if positions.dim() == 2:  # packed rows, each attending within itself (ops/documents.py)
            out = documents.attention(q, k, v, positions, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        latent: torch.Tensor,
        k_rot: torch.Tensor,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """Attention over the cached latent: q_nope [B, h, T, nope], q_rot [B, h, T, rope], the
        step's latent [B, T, rank] and rotated key [B, 1, T, rope] -> [B, T, hidden]."""
        batch, heads, seq, _ = q_nope.shape
        # (a quantized weight, ops/quantized_weight.py: dequantized to the step's dtype)
        weight = self.kv_b_proj.weight.to(q_nope.dtype).view(heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_k, w_v = weight.split([self.nope, self.v_dim], dim=1)  # this rank's heads under tensor parallelism
        q = torch.cat([q_nope @ w_k, q_rot], dim=-1)  # [B, h, T, rank + rope]
        entry = torch.cat([latent[:, None], k_rot], dim=-1)  # [B, 1, T, rank + rope]
        out = paged_attention(q, entry, None, cache, self.layer_idx, self.scale, value_dim=self.kv_lora_rank)
        out = out @ w_v.transpose(1, 2).to(out.dtype)  # [B, h, T, v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
