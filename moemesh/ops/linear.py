"""A linear layer whose weight gradient can wait (zero-bubble pipelines, `weight_grad.py`), with an
optional low-rank update computed in the same autograd node (LoRA, `models/adapted.py`):

    y = x·Wᵀ + (x_r·Aᵀ)·Bᵀ        x_r = x, or LoRA's dropout of it; A [r, in], B [out, r]

Backward computes the input's gradient at once, since the previous pipeline stage waits for it;
the weight gradient GEMMs run now or, inside a deferred backward, later from the queue. The result
is the same as `torch.nn.Linear`'s, under autocast too (the inputs are cast as autocast would cast
them for F.linear).

Why one node for the base and its update: a LoRA step is bound by the host's kernel launches
(bench/train/lora.py --count-ops). Here the update is added by the rank-r GEMM itself (addmm_ into the
base product), and in backward the input gradient of the update is accumulated the same way into
the base's: no separate scale, add or gradient-sum kernels. A and B come in the compute dtype,
cast (and B scaled) once a forward by the caller, not at each use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.ops import gemv, invariant, recompute, weight_grad
from moemesh.ops.backend import autocast_inputs
from moemesh.ops.quantized_weight import for_backward


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., d] as [rows, d]."""
    return t.reshape(-1, t.shape[-1])


def _add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a·b in place, by the GEMM itself (out is a fresh contiguous product: its rows view)."""
    out.view(-1, out.shape[-1]).addmm_(_rows(a), b)


class _Linear(torch.autograd.Function):
    """Keeps the base weight as given and casts it to x's dtype again in backward (see grouped_mm;
    the low-rank factors are small and come already cast) — but a quantized base's dense copy, in
    a checkpointed layer, is made once for the recomputation and backward (`for_backward`). The
    weights are held on ctx, not saved: activation checkpointing would detach them. The output,
    and the rank-r product x_r·Aᵀ that backward needs, are `recompute.kept`: selective activation
    checkpointing does not compute them twice."""

    @staticmethod
    def forward(ctx, x, weight, a, b, x_low_rank):
        ctx.weight, ctx.a, ctx.b = weight, a, b
        dense, base = for_backward(x, weight)  # a quantized weight's dense copy, or None
        if a is None:
            ctx.save_for_backward(x, dense)
            return recompute.kept(lambda: F.linear(x, base.to(x.dtype)))
        low_rank = recompute.kept(lambda: F.linear(x if x_low_rank is None else x_low_rank, a))

        def compute() -> torch.Tensor:
            out = F.linear(x, base.to(x.dtype))
            _add_product(out, low_rank, b.t())  # the update added by its own GEMM
            return out

        ctx.save_for_backward(x, dense, low_rank, x_low_rank)
        return recompute.kept(compute)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, dense, *rest = ctx.saved_tensors
        weight, a, b = ctx.weight, ctx.a, ctx.b
        needs_x, needs_weight, needs_a, needs_b, needs_x_r = ctx.needs_input_grad
        grad = grad.contiguous()
        grad_x = grad @ (weight if dense is None else dense).to(x.dtype) if needs_x else None
        grad_x_r = grad_low_rank = None
        if a is not None:
            low_rank, x_low_rank = rest
            x_r = x if x_low_rank is None else x_low_rank
            if needs_x or needs_x_r or needs_a:
                grad_low_rank = grad @ b
            if needs_x_r:  # LoRA's dropout: the update's input is not x
                grad_x_r = grad_low_rank @ a
            elif needs_x and x_low_rank is None:
                _add_product(grad_x, grad_low_rank, a)  # the update's share, added by its GEMM
        if not (needs_weight or needs_a or needs_b):
            return grad_x, None, None, None, grad_x_r

        def weight_gradients() -> list[torch.Tensor | None]:
            return [
                (_rows(grad).T @ _rows(x)).to(weight.dtype) if needs_weight else None,
                _rows(grad_low_rank).T @ _rows(x_r) if needs_a else None,
                _rows(grad).T @ _rows(low_rank) if needs_b else None,
            ]

        # Deferred: the queued job sends the gradients into the weights' own graphs (an autocast
        # cast, LoRA's cast factors, or the parameters themselves), as returning them would have.
        if weight_grad.put(lambda: weight_grad.send_gradients(weight_gradients(), (weight, a, b))):
            return grad_x, None, None, None, grad_x_r
        return grad_x, *weight_gradients(), grad_x_r


class _SharedInputLinears(torch.autograd.Function):
    """[x·W_iᵀ + (x·A_iᵀ)·B_iᵀ] for projections of one input (attention's q, k, v), the A_i stacked
    as one A [Σ r_i, in]: one GEMM gives every rank-r product, and backward gives x's gradient once,
    the base GEMMs and the stacked update accumulating into it (no gradient sums). Otherwise as
    `_Linear` (weights on ctx, outputs and the rank-r products kept, deferrable weight gradients)."""

    @staticmethod
    def forward(ctx, x, a, *weights_and_bs):
        count = len(weights_and_bs) // 2
        weights, bs = weights_and_bs[:count], weights_and_bs[count:]
        ctx.a, ctx.weights, ctx.bs = a, weights, bs
        low_rank = recompute.kept(lambda: F.linear(x, a))
        dense, bases = zip(*(for_backward(x, weight) for weight in weights))  # quantized weights' dense copies

        def project(weight: torch.Tensor, piece: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, weight.to(x.dtype))
            _add_product(out, piece, b.t())
            return out

        pieces = low_rank.split([b.shape[1] for b in bs], dim=-1)
        outs = [recompute.kept(lambda w=w, p=p, b=b: project(w, p, b)) for w, p, b in zip(bases, pieces, bs)]
        ctx.save_for_backward(x, low_rank, *dense)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, low_rank, *dense = ctx.saved_tensors
        a, weights, bs = ctx.a, ctx.weights, ctx.bs
        bases = [weight if copy is None else copy for weight, copy in zip(weights, dense)]
        needs = ctx.needs_input_grad
        needs_weights, needs_bs = needs[2 : 2 + len(weights)], needs[2 + len(weights) :]
        grads = [g.contiguous() for g in grads]
        ranks = [b.shape[1] for b in bs]
        grad_low_rank = x.new_empty(*x.shape[:-1], sum(ranks))
        for grad, b, piece in zip(grads, bs, grad_low_rank.split(ranks, dim=-1)):
            torch.mm(_rows(grad), b, out=_rows(piece))
        grad_x = None
        if needs[0]:
            grad_x = grads[0] @ bases[0].to(x.dtype)
            for grad, weight in zip(grads[1:], bases[1:]):
                _add_product(grad_x, grad, weight.to(x.dtype))
            _add_product(grad_x, grad_low_rank, a)

        def weight_gradients() -> list[torch.Tensor | None]:
            pieces = low_rank.split(ranks, dim=-1)
            return [
                _rows(grad_low_rank).T @ _rows(x) if needs[1] else None,
                *[(_rows(g).T @ _rows(x)).to(w.dtype) if n else None for g, w, n in zip(grads, weights, needs_weights)],
                *[_rows(g).T @ _rows(p) if n else None for g, p, n in zip(grads, pieces, needs_bs)],
            ]

        nothing = [None] * (1 + 2 * len(weights))
        if not any(needs[1:]):
            return grad_x, *nothing
        if weight_grad.put(lambda: weight_grad.send_gradients(weight_gradients(), (a, *weights, *bs))):
            return grad_x, *nothing
        return grad_x, *weight_gradients()


def linears(
    x: torch.Tensor, weights: list[torch.Tensor], a: torch.Tensor, bs: list[torch.Tensor]
) -> list[torch.Tensor]:
    """[x·W_iᵀ + (x·A_iᵀ)·B_iᵀ] for projections of one input x: A the A_i [r_i, in] stacked
    ([Σ r_i, in]), B_i [out_i, r_i], both in the compute dtype. One autograd node: x is read once
    for every rank-r product, and its gradient is accumulated by the GEMMs themselves."""
    if invariant.on():
        raise ValueError("batch-invariant mode does not cover LoRA adapters: merge them first")
    (x,) = autocast_inputs(x)
    return list(_SharedInputLinears.apply(x, a, *weights, *bs))


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_low_rank: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) with a deferrable weight gradient; for a few rows without
    gradients (decoding) on a Triton device, `ops/gemv.py`'s kernel. `low_rank` (A [r, in],
    B [out, r], in the compute dtype) adds (x_low_rank or x)·Aᵀ·Bᵀ."""
    (x,) = autocast_inputs(x)
    if invariant.on():
        if low_rank is not None:
            raise ValueError("batch-invariant mode does not cover LoRA adapters: merge them first")
        return invariant.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if low_rank is None and gemv.fits(rows, weight):
        out = gemv.gemv(rows, [weight])[0].view(*x.shape[:-1], weight.shape[0])
    else:
        out = _Linear.apply(x, weight, *(low_rank or (None, None)), x_low_rank)
    return out if bias is None else out + bias.to(out.dtype)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
