"""The dense building blocks: RMSNorm, rotary application, grouped-query attention, the gated MLP,
and the KV cache used for generation. Numerics follow Hugging Face `transformers` so that logits
match it to float32 rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.config import ModelConfig
from moemesh.ops.linear import Linear
from moemesh.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32, cast back before the scale, as transformers does (ops/rms_norm.py).
        return rms_norm(x, self.weight, self.eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [T, D]."""
    return x * cos + rotate_half(x) * sin


class KVCache:
    """Keys and values of the tokens seen so far, per layer, for incremental decoding."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def seq_length(self) -> int:
        return next(iter(self.keys.values())).shape[2] if self.keys else 0

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx in self.keys:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v


def attention_mask(q_positions: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean [Tq, Tk] mask, True where query i may attend key j (causal, optionally banded)."""
    k_positions = torch.arange(kv_len, device=q_positions.device)
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return allowed


class Attention(nn.Module):
    """Grouped-query attention with RoPE and, for Qwen3, an RMSNorm on every query and key head;
    for GPT-OSS, attention sinks and a sliding window on the layers `layer_types` marks."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        self.sliding_window = config.layer_sliding_window(layer_idx)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One learned logit per head, competing with the keys in the softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                cache: KVCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)

        kv_len = k.shape[2]
        plain_causal = kv_len == seq and (self.sliding_window is None or seq <= self.sliding_window)
        mask = None if plain_causal else attention_mask(positions, kv_len, self.sliding_window)
        if self.sinks is not None:
            if mask is None:
                mask = attention_mask(positions, kv_len, None)
            out = sink_attention(q, k, v, mask, self.sinks)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=plain_causal,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q·k / sqrt(D), sink]) without the sink's column, times v. The sink only enlarges
    the denominator, so a head can attend to nothing. q: [B, h, T, D], k/v: [B, h_kv, Tk, D],
    mask: [T, Tk] boolean. Computed explicitly (scaled_dot_product_attention takes no sinks)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return probs.to(v.dtype) @ v


# hidden_act -> the gate's activation, as transformers' ACT2FN computes it.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DenseMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) of the dense (non-MoE) layers."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
