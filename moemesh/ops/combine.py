"""Combine: weighted ragged gather that brings expert outputs back to their tokens.

    out[t] = sum_j weights[t, j] * grouped[position[t, j]]       (fp32 accumulation)

`position` comes from `permute` and must map distinct (token, slot) pairs to distinct rows. With
`skip`, a position of -1 marks a slot that reads no row: it adds nothing and gets a zero weight
gradient (expert parallelism's slots served on another rank), with no zero row to point at.

`combine_pairs` is the decode step's form (forward only): a row for each (token, slot) pair in
order, so the positions are implied and not made — on a rank holding some of the experts, the
slots whose expert is another rank's read nothing, decided from the ids in the kernel.
The backward is a fan-out: one program per token reads its `grad_out` row k times (from cache),
writes `weights[t, j] * grad_out[t]` to row position[t, j] of the gradient of `grouped`, and in the
same pass computes the routing-weight gradient <grad_out[t], grouped[position[t, j]]> -- with no
padded [T*k, H] fp32 intermediate. Rows of `grouped` that no token maps to (padding) get zeros.
"""

import torch

from moemesh.ops.backend import block_size, tl, triton, use_triton
from moemesh.ops.permute import padding_rows


def combine(grouped: torch.Tensor, position: torch.Tensor, weights: torch.Tensor, skip: bool = False) -> torch.Tensor:
    """`grouped [N, H]`, `position [T, k]`, `weights [T, k]` -> `out [T, H]` in grouped.dtype;
    `skip`: positions of -1 read nothing."""
    if grouped.dim() != 2 or position.dim() != 2 or weights.shape != position.shape:
        raise ValueError(
            f"need grouped [N, H], position [T, k], weights [T, k]; got {tuple(grouped.shape)}, "
            f"{tuple(position.shape)}, {tuple(weights.shape)}"
        )
    if use_triton(grouped):
        return _Combine.apply(grouped, position, weights, skip)
    return combine_reference(grouped, position, weights, skip)


def combine_pairs(
    rows: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    first_expert: int = 0,
    experts: int | None = None,
) -> torch.Tensor:
    """`rows [T·k, H]` (row t·k + j: token t's slot j), `expert_ids` and `weights [T, k]` -> `out
    [T, H]`: out[t] = Σ_j weights[t, j] · rows[t·k + j] over the slots whose expert lies in
    [first_expert, first_expert + experts) (all of them without `experts`). Forward only."""
    if rows.dim() != 2 or expert_ids.shape != weights.shape or rows.shape[0] != expert_ids.numel():
        raise ValueError(
            f"need rows [T·k, H], expert_ids and weights [T, k]; got {tuple(rows.shape)}, "
            f"{tuple(expert_ids.shape)}, {tuple(weights.shape)}"
        )
    last = None if experts is None else first_expert + experts
    if not use_triton(rows):
        here = expert_ids >= first_expert
        if last is not None:
            here &= expert_ids < last
        positions = torch.arange(rows.shape[0], device=rows.device).view_as(expert_ids)
        return combine_reference(rows, torch.where(here, positions, -1), weights, skip=True)
    num_tokens, k = expert_ids.shape
    out = rows.new_empty(num_tokens, rows.shape[1])
    if out.numel():
        block = block_size(rows.shape[1])
        _combine_kernel[(num_tokens, triton.cdiv(rows.shape[1], block))](
            rows, expert_ids.contiguous(), weights.contiguous(), out, rows.shape[1], k, BLOCK_H=block,
            PAIRS=True, first_expert=first_expert, last_expert=last if last is not None else 2**62,
        )  # fmt: skip
    return out


def combine_reference(
    grouped: torch.Tensor, position: torch.Tensor, weights: torch.Tensor, skip: bool = False
) -> torch.Tensor:
    num_tokens, k = position.shape
    compute = torch.promote_types(grouped.dtype, torch.float32)  # fp32, or fp64 for gradcheck
    if skip:  # a skipped slot reads row 0 with weight 0 (and row 0's gradient gets 0 from it)
        weights = torch.where(position < 0, 0.0, weights)
        position = position.clamp(min=0)
    rows = grouped[position.reshape(-1)].to(compute).view(num_tokens, k, grouped.shape[1])
    return (weights.to(compute).unsqueeze(-1) * rows).sum(dim=1).to(grouped.dtype)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, grouped, position, weights, skip):
        grouped, position, weights = grouped.contiguous(), position.contiguous(), weights.contiguous()
        # The expert outputs are kept only for the routing-weight gradient.
        ctx.save_for_backward(grouped if ctx.needs_input_grad[2] else None, position, weights)
        ctx.num_rows, ctx.skip = grouped.shape[0], skip
        return combine_triton(grouped, position, weights)

    @staticmethod
    def backward(ctx, grad_out):
        grouped, position, weights = ctx.saved_tensors
        grad_grouped, grad_weights = combine_backward_triton(
            grad_out, position, weights, ctx.num_rows, grouped, need_grouped=ctx.needs_input_grad[0], skip=ctx.skip
        )
        return grad_grouped, None, grad_weights, None


def combine_triton(grouped: torch.Tensor, position: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    num_tokens, k = position.shape
    hidden = grouped.shape[1]
    out = grouped.new_empty(num_tokens, hidden)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    block = block_size(hidden)
    grid = (num_tokens, triton.cdiv(hidden, block))
    _combine_kernel[grid](grouped, position, weights, out, hidden, k, BLOCK_H=block)
    return out


def combine_backward_triton(grad_out, position, weights, num_rows, grouped=None, need_grouped=True, skip=False):
    """Gradients of combine for `grad_out [T, H]`: of `grouped` ([num_rows, H]; None unless
    need_grouped) and of `weights` (None unless the forward's `grouped` is given). With `skip`
    the rows no slot reads are unknown on the host, so the whole gradient starts at zero."""
    grad_out = grad_out.contiguous()
    num_tokens, k = position.shape
    hidden = grad_out.shape[1]
    need_weights = grouped is not None
    grad_grouped = None
    if need_grouped:
        grad_grouped = grad_out.new_zeros(num_rows, hidden) if skip else grad_out.new_empty(num_rows, hidden)
    grad_weights = torch.zeros_like(weights) if need_weights else None
    if need_grouped and not skip and num_rows > position.numel():
        grad_grouped.index_fill_(0, padding_rows(position, num_rows), 0)
    if (need_grouped or need_weights) and num_tokens * k * hidden > 0:
        block = block_size(hidden)
        _combine_backward_kernel[(num_tokens,)](
            grad_out, grouped if need_weights else grad_out, position, weights,
            grad_grouped if need_grouped else grad_out,  # placeholder pointers are never touched
            grad_weights if need_weights else weights,
            hidden, k, BLOCK_H=block, NEED_GROUPED=need_grouped, NEED_WEIGHTS=need_weights,
        )  # fmt: skip
    return grad_grouped, grad_weights


@triton.jit
def _combine_kernel(
    grouped_ptr, position_ptr, weights_ptr, out_ptr, hidden, k, BLOCK_H: tl.constexpr,
    PAIRS: tl.constexpr = False, first_expert=0, last_expert=0,
):  # fmt: skip
    """PAIRS (`combine_pairs`): position_ptr holds the expert ids, slot j of token t reads row
    t·k + j if its expert is in [first_expert, last_expert)."""
    token = tl.program_id(0).to(tl.int64)  # 64-bit: row * hidden can pass 2**31
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(k):
        row = tl.load(position_ptr + token * k + j).to(tl.int64)
        if PAIRS:
            row = tl.where((row >= first_expert) & (row < last_expert), token * k + j, -1)
        weight = tl.load(weights_ptr + token * k + j).to(tl.float32)
        read = mask & (
            cols * 0 + row >= 0
        )  # -1: skipped (the test as a block: a scalar mask is not accepted everywhere)
        acc += weight * tl.load(grouped_ptr + row * hidden + cols, mask=read, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(
    grad_out_ptr, grouped_ptr, position_ptr, weights_ptr, grad_grouped_ptr, grad_weights_ptr,
    hidden, k, BLOCK_H: tl.constexpr, NEED_GROUPED: tl.constexpr, NEED_WEIGHTS: tl.constexpr,
):  # fmt: skip
    # One program per token walks the whole row, so the weight gradient's dot product over H needs
    # no cross-program reduction (deterministic, no atomics).
    token = tl.program_id(0).to(tl.int64)
    for j in range(k):
        row = tl.load(position_ptr + token * k + j).to(tl.int64)
        weight = tl.load(weights_ptr + token * k + j).to(tl.float32)
        dot = tl.zeros([BLOCK_H], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            mask = (cols < hidden) & (cols * 0 + row >= 0)  # -1: skipped
            grad = tl.load(grad_out_ptr + token * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            if NEED_GROUPED:
                value = (weight * grad).to(grad_grouped_ptr.dtype.element_ty)
                tl.store(grad_grouped_ptr + row * hidden + cols, value, mask=mask)
            if NEED_WEIGHTS:
                expert_out = tl.load(grouped_ptr + row * hidden + cols, mask=mask, other=0.0)
                dot += grad * expert_out.to(tl.float32)
        if NEED_WEIGHTS:
            grad_weight = tl.sum(dot, axis=0).to(grad_weights_ptr.dtype.element_ty)
            tl.store(grad_weights_ptr + token * k + j, grad_weight)
