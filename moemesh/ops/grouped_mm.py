"""Grouped matrix multiply: rows of `x` are grouped by expert, and each group is multiplied by
its own expert's weight.

On CUDA in bf16 this is one `grouped_mm` launch (no host synchronisation); elsewhere (CPU, fp32,
or rows narrower than the kernel's 16-byte alignment: a LoRA rank that is not a multiple of 8) it
is a loop over experts, which is exact and needs the group sizes on the host.

LoRA on an expert bank (`models/lora.py`) rides the same autograd node: each group's rows times
its expert's A_e, then B_e, two grouped GEMMs of rank r over all experts at once, the update added
in place to the base product; in backward the update's share of the input gradient is added to the
base's the same way. A LoRA step is bound by the host's kernel launches (bench/train/lora.py
--count-ops), so a layer computes the kernel's group offsets once for all its grouped GEMMs
(`group_offsets`) and backward reuses them, and the factors come cast (and B scaled) once a
forward by the caller, not at each use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moemesh.ops import quantized_grouped_mm, recompute, weight_grad
from moemesh.ops.backend import autocast_inputs
from moemesh.ops.quantized_weight import QuantizedWeight, for_backward

# torch >= 2.10 exposes the public name; 2.9 only the private one.
_grouped_mm_kernel = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _use_kernel(x: torch.Tensor) -> bool:
    """Whether the grouped GEMMs of `x` (their weights cast to its dtype) run as one kernel launch."""
    return (
        _grouped_mm_kernel is not None
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (8, 0)
    )


def group_offsets(x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor | None:
    """The groups' end rows (int32 cumulative sizes) that the kernel takes, or None where the CPU
    loop runs instead. One computation can serve every grouped GEMM of a layer."""
    return torch.cumsum(group_sizes, dim=0, dtype=torch.int32) if _use_kernel(x) else None


def _fits(*widths: int) -> bool:
    """Whether the kernel takes matrices of these row widths: its rows start on 16 bytes (8 bf16
    numbers). A narrower LoRA rank (4, say) takes the loop instead."""
    return all(width % 8 == 0 for width in widths)


def product(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor, offsets) -> torch.Tensor:
    """out[rows of group e] = x[rows of group e] @ weight[e].T, for weight [E, O, K], without
    autograd (rows past the last group: 0 on the CPU loop, unwritten by the kernel)."""
    if offsets is not None and _fits(*weight.shape[1:]):
        return _grouped_mm_kernel(x, weight.transpose(-2, -1), offs=offsets)
    *pieces, rest = torch.split(x, _sizes_and_rest(group_sizes, len(x)))
    return torch.cat(
        [
            *(piece @ w.transpose(0, 1) for piece, w in zip(pieces, weight.unbind(0))),
            rest.new_zeros(len(rest), weight.shape[1]),
        ]
    )


def base_product(x: torch.Tensor, weight, group_sizes: torch.Tensor, offsets, transposed: bool = False) -> torch.Tensor:
    """`product` with the bank `weight` (its [E, K, O] transpose, `transposed`) in x's dtype. An
    FP8 bank's untransposed product on a GPU reads the codes (ops/quantized_grouped_mm.py); any
    other quantized bank (ops/quantized_weight.py) is dequantized for the product: whole when that takes
    at most `DENSE_BANK_BYTES`, else a run of experts at a time (the group sizes read on the host),
    so that a bank of gpt-oss-120b's (4.2 GB in bf16) never lives whole beside the model. Inside a
    CUDA graph's capture (the engine's packed steps) the host cannot read the group sizes: there
    the bank is dequantized whole, a temporary of one bank in the compute dtype."""
    if not transposed and quantized_grouped_mm.applies(x, weight):
        return quantized_grouped_mm.quantized_grouped_mm(x, weight, group_sizes)
    if _by_runs(x, weight):
        return _product_by_runs(x, weight, group_sizes, transposed)
    dense = weight.to(x.dtype)
    return product(x, dense.transpose(-2, -1) if transposed else dense, group_sizes, offsets)


DENSE_BANK_BYTES = 2**30


def _by_runs(x: torch.Tensor, weight) -> bool:
    """Whether `base_product` dequantizes the quantized bank `weight` a run of experts at a time."""
    if not isinstance(weight, QuantizedWeight) or weight.numel() * x.element_size() <= DENSE_BANK_BYTES:
        return False
    return not recompute.capturing()


def shared_bank(x: torch.Tensor, weight) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(what to save for backward, the bank the forward's product reads): `quantized_weight.
    for_backward`, which dequantizes a checkpointed layer's quantized bank once, in its
    recomputation, for that and backward. The first run's product reads the quantized bank (on a
    GPU, an FP8 bank by `ops/quantized_grouped_mm.py`'s kernel, which dequantizes nothing): a step
    of the LoRA recipe on an FP8 base dequantizes each bank once. A bank dequantized a run at a
    time is not held whole (None, `weight`)."""
    if _by_runs(x, weight):
        return None, weight
    return for_backward(x, weight)


def _product_by_runs(x: torch.Tensor, weight, group_sizes: torch.Tensor, transposed: bool) -> torch.Tensor:
    experts = weight.shape[0]
    run = max(1, DENSE_BANK_BYTES * experts // (weight.numel() * x.element_size()))
    *sizes, rest = _sizes_and_rest(group_sizes, len(x))
    pieces, row = [], 0
    for first in range(0, experts, run):
        last = min(first + run, experts)
        rows = sum(sizes[first:last])
        dense = weight.experts(slice(first, last)).to(x.dtype)
        here, runs = x.narrow(0, row, rows), group_sizes[first:last]
        pieces.append(product(here, dense.transpose(-2, -1) if transposed else dense, runs, group_offsets(here, runs)))
        row += rows
    out_features = weight.shape[-1] if transposed else weight.shape[-2]
    return torch.cat([*pieces, x.new_zeros(rest, out_features)])


def _sizes_and_rest(group_sizes: torch.Tensor, rows: int) -> list[int]:
    """The group sizes on the host, and last the rows past the last group (a buffer that expert
    parallelism sized before knowing its routing: no group reads them, and their output is 0)."""
    sizes = group_sizes.tolist()
    return [*sizes, rows - sum(sizes)]


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor, offsets) -> torch.Tensor:
    """[E, O, K]: grad[rows of e].T @ x[rows of e] for every group e (rows past the groups left
    out); `offsets`: `group_offsets`'."""
    if offsets is not None and _fits(grad.shape[-1], x.shape[-1]):
        return _grouped_mm_kernel(grad.transpose(0, 1), x, offs=offsets)
    sizes = _sizes_and_rest(group_sizes, len(x))
    *grads, _ = torch.split(grad, sizes)
    *pieces, _ = torch.split(x, sizes)
    return torch.stack([g.transpose(0, 1) @ piece for g, piece in zip(grads, pieces)])


class _GroupedMM(torch.autograd.Function):
    """Keeps the weight as given (the fp32 parameter under autocast) and casts it again in
    backward: a saved bf16 copy would stay alive per micro-batch in flight, and a pipeline stage
    holds several (the low-rank factors are small and come already cast). The weights are held on
    ctx, not saved: activation checkpointing detaches the tensors it recomputes, and a deferred
    weight gradient must reach the weight's own graph. The output, and the rank-r product that
    backward needs, are `recompute.kept`: selective activation checkpointing does not compute
    them twice.

    Inside a CUDA graph's capture the factors are saved instead: no weight gradient is deferred
    there (graphs run one process), so the factors need not reach backward as the forward's own
    tensors, and activation checkpointing then drops the forward's copies after the layer — the
    recomputation casts them again (`recompute.reused`) — rather than holding every layer's
    through the step (1.2 GiB of bf16 factors for r=16 on every expert of Qwen3-30B-A3B)."""

    @staticmethod
    def forward(ctx, x, weight, a, b, x_low_rank, group_sizes, offsets):
        held = not recompute.capturing()
        ctx.weight, ctx.a, ctx.b = weight, *((a, b) if held else (None, None))
        groups = (group_sizes, offsets)
        dense, base = shared_bank(x, weight)  # saved: None, or the bank backward would dequantize again
        factors = (None, None) if held else (a, b)
        if a is None:
            ctx.save_for_backward(x, group_sizes, offsets, dense, *factors)
            return recompute.kept(lambda: base_product(x, base, *groups))
        low_rank = recompute.kept(lambda: product(x if x_low_rank is None else x_low_rank, a, *groups))
        ctx.save_for_backward(x, group_sizes, offsets, dense, *factors, low_rank, x_low_rank)
        return recompute.kept(lambda: base_product(x, base, *groups).add_(product(low_rank, b, *groups)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, group_sizes, offsets, dense, saved_a, saved_b, *rest = ctx.saved_tensors
        a, b = (ctx.a, ctx.b) if ctx.a is not None else (saved_a, saved_b)
        weight, groups = ctx.weight, (group_sizes, offsets)
        needs_x, needs_weight, needs_a, needs_b, needs_x_r = ctx.needs_input_grad[:5]
        grad = grad.contiguous()
        base = weight if dense is None else dense
        grad_x = base_product(grad, base, *groups, transposed=True) if needs_x else None
        grad_x_r = grad_low_rank = None
        if rest:  # LoRA: its rank-r product and input were saved
            low_rank, x_low_rank = rest
            x_r = x if x_low_rank is None else x_low_rank
            if needs_x or needs_x_r or needs_a:
                grad_low_rank = product(grad, b.transpose(-2, -1), *groups)
            if needs_x_r:  # LoRA's dropout: the update's input is not x
                grad_x_r = product(grad_low_rank, a.transpose(-2, -1), *groups)
            elif needs_x and x_low_rank is None:
                grad_x.add_(product(grad_low_rank, a.transpose(-2, -1), *groups))
        nothing = (None, None)
        if not (needs_weight or needs_a or needs_b):
            return grad_x, None, None, None, grad_x_r, *nothing

        def weight_gradients() -> list[torch.Tensor | None]:
            return [
                weight_gradient(grad, x, *groups).to(weight.dtype) if needs_weight else None,
                weight_gradient(grad_low_rank, x_r, *groups) if needs_a else None,
                weight_gradient(grad, low_rank, *groups) if needs_b else None,
            ]

        # Deferred (a zero-bubble pipeline's backward, `weight_grad.py`): the queued job sends the
        # gradients into the weights' graphs, as returning them here would have.
        if weight_grad.put(lambda: weight_grad.send_gradients(weight_gradients(), (weight, a, b))):
            return grad_x, None, None, None, grad_x_r, *nothing
        return grad_x, *weight_gradients(), grad_x_r, *nothing


def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_sizes: torch.Tensor,
    offsets: torch.Tensor | None = None,
    low_rank: tuple[torch.Tensor, torch.Tensor] | None = None,
    x_low_rank: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [N, K], rows sorted by group; weight: [E, O, K]; group_sizes: [E] integers summing to at
    most N. Returns [N, O] with out[rows of group e] = x[rows of group e] @ weight[e].T; rows past
    the last group belong to none (their output is 0 on the CPU loop, unwritten by the kernel). The weight
    gradient may be deferred (`weight_grad.py`). `offsets`: `group_offsets(x, group_sizes)`, when
    the caller has it. `low_rank` (A [E, r, K], B [E, O, r], in the compute dtype) adds each
    group's (x_low_rank or x)·A_eᵀ·B_eᵀ, in the same autograd node."""
    (x,) = autocast_inputs(x)
    if offsets is None:
        offsets = group_offsets(x, group_sizes)
    return _GroupedMM.apply(x, weight, *(low_rank or (None, None)), x_low_rank, group_sizes, offsets)
