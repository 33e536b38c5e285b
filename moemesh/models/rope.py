"""Rotary position embeddings: plain RoPE, YaRN-scaled (`rope_scaling` with rope_type "yarn") or
proportional (rope_type "proportional", Gemma 4's global layers), computed as transformers'
`modeling_rope_utils` does, operation for operation, so that the tables agree bit for bit.

YaRN stretches the slow frequencies by `factor` (interpolation) and keeps the fast ones
(extrapolation), blending over a ramp between the dims that turn beta_fast and beta_slow times in
the original context; it also scales cos/sin by an attention factor. DeepSeek's latent attention
further multiplies its softmax scale by mscale(factor, mscale_all_dim)² (`softmax_scale`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

# The rope_scaling keys transformers reads, per rope_type (rope_theta lives on ModelConfig).
KEYS = {
    "yarn": {
        "rope_type",
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "proportional": {"rope_type", "factor", "partial_rotary_factor"},
}


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(rope: dict[str, Any], max_position_embeddings: int) -> float:
    # No factor: the ratio of the context lengths (DeepSeek-V3's convention).
    factor = rope.get("factor")
    return factor if factor is not None else max_position_embeddings / rope["original_max_position_embeddings"]


def yarn(dim: int, theta: float, rope: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """-> (inverse frequencies [dim // 2], the factor scaling cos and sin)."""
    factor = yarn_factor(rope, max_position_embeddings)
    original = rope["original_max_position_embeddings"]
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times in `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the dim keeps its frequency (extrapolates), 0: it is interpolated
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def proportional(dim: int, theta: float, rope: dict[str, Any]) -> torch.Tensor:
    """Plain frequencies (exponents over the whole dim) on the first partial_rotary_factor of the
    pairs, zero (no rotation) on the rest, all divided by factor. -> inverse frequencies [dim // 2]."""
    angles = int(rope.get("partial_rotary_factor", 1.0) * dim // 2)
    inv_freq = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float() / dim))
    inv_freq = torch.cat([inv_freq, torch.zeros(dim // 2 - angles, device="cpu")])
    return inv_freq / rope.get("factor", 1.0)


def softmax_scale(head_dim: int, rope: dict[str, Any] | None, max_position_embeddings: int) -> float:
    """DeepSeek's attention scale: head_dim^-0.5, times mscale(factor, mscale_all_dim)² under YaRN."""
    scale = head_dim**-0.5
    if rope is not None and rope.get("mscale_all_dim"):
        mscale = _mscale(yarn_factor(rope, max_position_embeddings), rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    return scale


class RotaryEmbedding:
    """cos/sin tables for given positions. Not a module: it holds no state worth saving, and the
    inverse frequencies are computed on the CPU in fp32 (like transformers) so every device agrees."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None = None, max_position_embeddings: int = 0
    ):
        rope_type = (scaling or {}).get("rope_type", "default")
        self.attention_factor = 1.0
        if rope_type == "yarn":
            self.inv_freq, self.attention_factor = yarn(head_dim, theta, scaling, max_position_embeddings)
        elif rope_type == "proportional":
            self.inv_freq = proportional(head_dim, theta, scaling)
        else:
            exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
            self.inv_freq = 1.0 / (theta**exponent)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions[..., None].float() * inv_freq  # [T, D/2], or [B, T, D/2] for per-row positions
        angles = torch.cat([freqs, freqs], dim=-1)
        # Scaled in fp32 before the cast, as transformers does (a factor of 1 changes nothing).
        return (angles.cos() * self.attention_factor).to(dtype), (angles.sin() * self.attention_factor).to(dtype)
