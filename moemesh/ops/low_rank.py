"""LoRA's factors in the compute dtype, made once a forward (`models/lora.py`, `models/moe.py`).

The adapters are trained in fp32 (train.param_dtype) beside a bf16 base, so each forward needs
bf16 copies of A and B. `low_rank_factors` makes them once per forward of the module that holds
them, with the LoRA scale s folded into B's copy: A in the compute dtype, s·B in it. Their
autograd nodes send the gradients back to the fp32 parameters (s·grad for B). Under activation
checkpointing the recomputation in backward reuses the forward's copies (`recompute.reused`), and
the backward of `ops/linear.py` and `ops/grouped_mm.py` takes them as they are.

Why: a LoRA step is bound by the host's kernel launches (bench/train/lora.py --count-ops). Casting at
each use cast every factor four times a step (forward, recomputation, backward, and its gradient
back to fp32), and the scale was one more elementwise kernel over the update's output in forward,
recomputation and backward. Now: one kernel a factor in forward, one in backward (the scale rides
the cast: `torch.mul` into a tensor of the other dtype). The copies live until backward, as the
rest of the graph does: 2 bytes a trained parameter in bf16 (1.2 GiB for r=16 on attention and
every expert of Qwen3-30B-A3B's 48 layers).

Inside a CUDA graph (train.cuda_graphs) launches cost the host nothing, and that memory is what
matters: there a recomputation casts again (`recompute.reused` computes while a graph is
captured) and the experts' grouped GEMMs save their factors rather than holding them, so an
expert bank's copies live only through its layer's forward and its backward (attention's, held
by `ops/linear.py`'s Functions, through the step: 27 MB for the recipe). The graphed LoRA step's
peak went from 70.6 to 69.3 GiB (one H200, 2026-12-02, bench/train/lora.py --cuda-graph on).
"""

from __future__ import annotations

import torch

from moemesh.ops import recompute


class _ScaledCast(torch.autograd.Function):
    """weight · scale in `dtype`, computed in weight's dtype and rounded once; backward gives
    grad · scale in weight's dtype. One kernel each way on a GPU."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        ctx.scale, ctx.dtype = scale, weight.dtype
        ctx.set_materialize_grads(False)
        return torch.mul(weight, scale, out=torch.empty_like(weight, dtype=dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:
            return None, None, None
        return torch.mul(grad, ctx.scale, out=torch.empty_like(grad, dtype=ctx.dtype)), None, None


def scaled_cast(weight: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """weight · scale in `dtype`, differentiable; weight itself when there is nothing to do."""
    if scale == 1.0:
        return weight.to(dtype)
    return _ScaledCast.apply(weight, scale, dtype)


def stacked_low_rank_factors(
    as_: list[torch.Tensor], bs: list[torch.Tensor], dtype: torch.dtype, scales: list[float]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The A_i stacked [Σ r_i, in] and each s_i·B_i, in `dtype`, once a forward: the factors of
    projections of one input (`ops/linear.py`'s `linears`). The stack is two kernels (concatenate,
    cast), its gradient one cast (then views)."""
    stacked = recompute.reused(lambda: torch.cat(as_).to(dtype))
    return stacked, [recompute.reused(lambda b=b, s=s: scaled_cast(b, dtype, s)) for b, s in zip(bs, scales)]


def low_rank_factors(
    a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, s·B) in `dtype`, once a forward: a checkpointed layer's recomputation gets the
    forward's copies back."""
    return recompute.reused(lambda: scaled_cast(a, dtype)), recompute.reused(lambda: scaled_cast(b, dtype, scale))
