"""Deterministic model construction.

Every parameter draws from its own generator, seeded from the model seed and the parameter's
name, on the CPU. So the initial weights are the same on any device and whatever else the model
holds: a pipeline stage or a shard that builds only its part gets the same values as one process
that builds everything.
"""

from __future__ import annotations

import zlib

import torch

from moemesh.models.config import ModelConfig
from moemesh.models.transformer import MoECausalLM


def build(config: ModelConfig, seed: int = 0, device: torch.device | str | None = None,
          dtype: torch.dtype | None = None) -> MoECausalLM:
    with torch.device("meta"):
        model = MoECausalLM(config)
    model.to_empty(device=device or "cpu")
    model.tie_weights()
    init_weights(model, seed)
    if dtype is not None:
        model.to(dtype)
    return model


@torch.no_grad()
def init_weights(model: MoECausalLM, seed: int) -> None:
    std = model.config.initializer_range
    for name, buffer in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias starts at zero
        buffer.fill_(1.0 if name.endswith("layer_scalar") else 0.0)  # Gemma 4's layer_scalar at one
    for name, param in model.named_parameters():
        generator = torch.Generator().manual_seed(parameter_seed(seed, name))
        if name.endswith(("norm.weight", "gate.scale", "per_expert_scale")):  # multipliers start at one
            values = torch.ones(param.shape)
        elif name.endswith((".bias", "_bias")):
            values = torch.zeros(param.shape)
        else:
            values = torch.empty(param.shape).normal_(0.0, std, generator=generator)
        param.copy_(values)


def parameter_seed(seed: int, name: str) -> int:
    # The CPU generator (mt19937) keeps only 32 bits of its seed, so hash seed and name together.
    return zlib.crc32(f"{seed}:{name}".encode())
