"""Grouped matrix multiply: rows of `x` are grouped by expert, and each group is multiplied by
its own expert's weight.

On CUDA in bf16 this is one `grouped_mm` launch (no host synchronisation); elsewhere (CPU, fp32)
it is a loop over experts, which is exact and needs the group sizes on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.ops import recompute, weight_grad
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


def _forward(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """out[rows of group e] = x[rows of group e] @ weight[e].T, for weight [E, O, K]."""
    if _use_kernel(x, weight):
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        return _grouped_mm_kernel(x, weight.transpose(-2, -1), offs=offsets)
    pieces = torch.split(x, group_sizes.tolist())
    return torch.cat([piece @ w.transpose(0, 1) for piece, w in zip(pieces, weight.unbind(0))])


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """[E, O, K]: grad[rows of e].T @ x[rows of e] for every group e."""
    if _use_kernel(x, grad):
        offsets = torch.cumsum(group_sizes, dim=0, dtype=torch.int32)
        return _grouped_mm_kernel(grad.transpose(0, 1), x, offs=offsets)
    sizes = group_sizes.tolist()
    pieces = zip(torch.split(grad, sizes), torch.split(x, sizes))
    return torch.stack([g.transpose(0, 1) @ piece for g, piece in pieces])


class _GroupedMM(torch.autograd.Function):
    """Keeps the weight as given (the fp32 parameter under autocast) and casts it again in
    backward: a saved bf16 copy would stay alive per micro-batch in flight, and a pipeline stage
    holds several. The weight is held on ctx, not saved: activation checkpointing detaches the
    tensors it recomputes, and a deferred weight gradient must reach the weight's own graph. The
    output is `recompute.kept`: selective activation checkpointing does not compute it twice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, group_sizes)
        ctx.weight = weight
        return recompute.kept(lambda: _forward(x, weight.to(x.dtype), group_sizes))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x, group_sizes), weight = ctx.saved_tensors, ctx.weight
        grad = grad.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _forward(grad, weight.to(x.dtype).transpose(-2, -1), group_sizes)
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None

        def weight_gradient() -> torch.Tensor:
            return _weight_gradient(grad, x, group_sizes).to(weight.dtype)

        # Deferred (a zero-bubble pipeline's backward, `weight_grad.py`): the queued job sends the
        # gradient into `weight`'s graph, as returning it here would have.
        if weight_grad.put(lambda: torch.autograd.backward(weight, weight_gradient())):
            return grad_x, None, None
        return grad_x, weight_gradient(), None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """x: [N, K], rows sorted by group; weight: [E, O, K]; group_sizes: [E] integers summing to N.
    Returns [N, O] with out[rows of group e] = x[rows of group e] @ weight[e].T. The weight
    gradient may be deferred (`weight_grad.py`)."""
    (x,) = autocast_inputs(x)
    return _GroupedMM.apply(x, weight, group_sizes)
