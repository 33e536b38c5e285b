"""Grouped matrix multiply: rows of `x` are grouped by expert, and each group is multiplied by
its own expert's weight.

On CUDA in bf16 this is one `grouped_mm` launch (no host synchronisation); elsewhere (CPU, fp32)
it is a loop over experts, which is exact and needs the group sizes on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.ops.backend import autocast_inputs

# torch >= 2.10 exposes the public name; 2.9 only the private one.
_grouped_mm_kernel = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        _grouped_mm_kernel is not None
        and x.is_cuda
        and x.dtype == weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x: [N, K], rows sorted by group; weight: [E, O, K]; group_sizes: [E] integers summing to N.
    Returns [N, O] with out[rows of group e] = x[rows of group e] @ weight[e].T."""
    x, weight = autocast_inputs(x, weight)
    if _use_kernel(x, weight):
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        return _grouped_mm_kernel(x, weight.transpose(-2, -1), offs=offsets)
    pieces = torch.split(x, group_sizes.tolist())
    # unbind, not weight[e]: its backward stacks the expert gradients once, where indexing would
    # add a full-size zero gradient per expert.
    return torch.cat([piece @ w.transpose(0, 1) for piece, w in zip(pieces, weight.unbind(0))])
