"""A linear layer whose weight gradient can wait (zero-bubble pipelines, `weight_grad.py`).

Backward computes the input's gradient at once, since the previous pipeline stage waits for it;
the weight's gradient GEMM runs now or, inside a deferred backward, later from the queue. The
result is the same as `torch.nn.Linear`'s, under autocast too (the inputs are cast as autocast
would cast them for F.linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.ops import gemv, recompute, weight_grad
from moemesh.ops.backend import autocast_inputs


class _Linear(torch.autograd.Function):
    """Keeps the weight as given and casts it to x's dtype again in backward (see grouped_mm). Its
    output is `recompute.kept`: selective activation checkpointing does not compute it twice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight = weight  # see grouped_mm: not a saved tensor, which checkpointing would detach
        return recompute.kept(lambda: F.linear(x, weight.to(x.dtype)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,), weight = ctx.saved_tensors, ctx.weight
        grad_x = grad @ weight.to(x.dtype) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None

        def weight_gradient() -> torch.Tensor:
            return (grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1])).to(weight.dtype)

        # Deferred: the queued job sends the gradient into `weight`'s own graph (an autocast cast,
        # or the parameter itself), as returning it here would have.
        if weight_grad.put(lambda: torch.autograd.backward(weight, weight_gradient())):
            return grad_x, None
        return grad_x, weight_gradient()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) with a deferrable weight gradient; for a few rows without
    gradients (decoding) on a Triton device, `ops/gemv.py`'s kernel."""
    (x,) = autocast_inputs(x)
    rows = x.reshape(-1, x.shape[-1])
    if gemv.fits(rows, weight):
        out = gemv.gemv(rows, [weight])[0].view(*x.shape[:-1], weight.shape[0])
    else:
        out = _Linear.apply(x, weight)
    return out if bias is None else out + bias.to(out.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
