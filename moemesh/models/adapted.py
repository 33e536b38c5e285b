"""How a projection with LoRA adapters computes (`models/lora.py` adds and removes them):

    y = x·Wᵀ + b + s · dropout(x)·Aᵀ·Bᵀ

A LoRA step is bound by the host's kernel launches (bench/train/lora.py --count-ops), so the adapters
never run as separate modules: each forward casts A and s·B to the compute dtype once
(`ops/low_rank.py`), and the update runs in the base's own autograd node (`ops/linear.py`).
Projections of one input — attention's q, k and v, the dense MLP's gate and up — share one node
(`projections`): their A are stacked so that one GEMM reads x for every rank-r product, and x's
gradient is accumulated by the GEMMs themselves instead of summed by autograd. That node calls no
module: hooks on those projections would not run (none is registered on them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.ops.backend import autocast_inputs
from moemesh.ops.linear import Linear, linear, linears
from moemesh.ops.low_rank import low_rank_factors, stacked_low_rank_factors


class LoraLinear(Linear):
    """A projection with adapters (`models/lora.py` turns a Linear into one in place, so its
    weight and bias keep their names and identity)."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_scaling: float
    lora_dropout: float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return adapted_linear(self, x, self.bias)


def has_adapter(module: nn.Module) -> bool:
    return getattr(module, "lora_A", None) is not None


def adapted_linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x·Wᵀ (+ bias) + s · dropout(x)·Aᵀ·Bᵀ of a module holding weight, lora_A, lora_B,
    lora_scaling and lora_dropout: one autograd node, the factors cast once a forward."""
    (x,) = autocast_inputs(x)
    dropped = F.dropout(x, module.lora_dropout) if module.lora_dropout and module.training else None
    factors = low_rank_factors(module.lora_A, module.lora_B, x.dtype, module.lora_scaling)
    return linear(x, module.weight, bias, factors, dropped)


def projections(x: torch.Tensor, *modules: nn.Module) -> list[torch.Tensor]:
    """[module(x) for module in modules]; in one autograd node when every one is adapted and no
    dropout draws a mask of its own (each adapter's would differ)."""
    if not all(has_adapter(m) for m in modules) or any(m.lora_dropout and m.training for m in modules):
        return [m(x) for m in modules]
    (x,) = autocast_inputs(x)
    a, bs = stacked_low_rank_factors(
        [m.lora_A for m in modules], [m.lora_B for m in modules], x.dtype, [m.lora_scaling for m in modules]
    )
    outs = linears(x, [m.weight for m in modules], a, bs)
    return [out if m.bias is None else out + m.bias.to(out.dtype) for out, m in zip(outs, modules)]
