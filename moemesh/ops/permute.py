"""Permute: copy each token's row once per routed expert, grouped by expert, for the expert GEMMs.

Routing sends token t to k experts (`topk_ids[t]`). `permute` builds `grouped`, whose rows are
sorted by expert and, within an expert, by (token, slot); each expert's group is padded with zero
rows to a multiple of `align` (some grouped-GEMM kernels want aligned groups). `position[t, j]` is
the row of `grouped` that holds token t's copy for its j-th expert; `combine` uses it to come back.

The index arithmetic (sort, searchsorted, cumsum) is plain torch. The row copy is a Triton kernel
that reads each token row once and writes its k copies; its backward sums the k copies' gradients
back into the token row, and saves only `position` -- never `x`.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemesh.ops.backend import block_size, tl, triton, use_triton


@dataclass(frozen=True)
class Permuted:
    grouped: torch.Tensor  # [N, H] token rows grouped by expert, zero rows as padding
    position: torch.Tensor  # [T, k] int64: row of `grouped` holding token t's copy for slot j
    counts: torch.Tensor  # [E] int64: real (unpadded) rows per expert
    offsets: torch.Tensor  # [E + 1] int64: padded group starts; offsets[-1] == N
    synced_offsets: tuple[int, ...] | None = None  # `offsets` on the host, when already copied

    @functools.cached_property
    def host_offsets(self) -> tuple[int, ...]:
        """`offsets` on the host (for a grouped GEMM's CPU loop); a device sync unless copied already."""
        return self.synced_offsets or tuple(self.offsets.tolist())

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """Padded rows per expert, on the host."""
        return tuple(b - a for a, b in zip(self.host_offsets[:-1], self.host_offsets[1:]))


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, align: int = 1) -> Permuted:
    """Group `x [T, H]` by expert for `topk_ids [T, k]`. Without padding (align 1) `grouped` has
    T·k rows and a GPU never waits for the host; with padding its size depends on the routing,
    which costs one device sync."""
    position, counts, offsets, host_offsets = routing_layout(x, topk_ids, num_experts, align)
    num_rows = topk_ids.numel() if host_offsets is None else host_offsets[-1]
    if use_triton(x):
        grouped = _PermuteRows.apply(x, position, num_rows, True)
    else:
        grouped = permute_rows_reference(x, position, num_rows)
    return Permuted(grouped, position, counts, offsets, host_offsets)


def permute_reference(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, align: int = 1) -> Permuted:
    """`permute` in plain torch (autograd does the backward)."""
    position, counts, offsets, host_offsets = routing_layout(x, topk_ids, num_experts, align)
    grouped = permute_rows_reference(x, position, topk_ids.numel() if host_offsets is None else host_offsets[-1])
    return Permuted(grouped, position, counts, offsets, host_offsets)


def _narrowest(num_experts: int) -> torch.dtype:
    """The narrowest integer type that holds the expert ids 0 .. num_experts - 1 (argsort keys)."""
    return torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 1 << 15 else torch.int64


def routing_layout(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, align: int):
    """(position [T, k], counts [E], offsets [E + 1], host_offsets) for `topk_ids [T, k]`.
    host_offsets is None on a GPU without padding: nothing needs it there, and copying it would
    make the host wait for the device (the ids then come from top-k and need no check)."""
    if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        shapes = f"{tuple(x.shape)} and {tuple(topk_ids.shape)}"
        raise ValueError(f"need x [T, H] and topk_ids [T, k], got {shapes}")
    if num_experts < 1 or align < 1:
        raise ValueError(f"num_experts ({num_experts}) and align ({align}) must be >= 1")
    expert = topk_ids.reshape(-1).long()  # (token, slot) order
    # stable: (token, slot) order within an expert. On a GPU the key is the narrowest type that
    # holds the ids (they come from top-k there): its radix sort makes a pass per byte of the key,
    # eight for int64. On the CPU the ids are checked below, so they stay as they are.
    key = expert.to(_narrowest(num_experts)) if expert.is_cuda else expert
    order = torch.argsort(key, stable=True)
    sorted_expert = expert[order]
    # starts[e] = number of entries whose expert id is below e (e = 0 .. E); no sync, unlike bincount
    starts = torch.searchsorted(sorted_expert, torch.arange(num_experts + 1, device=expert.device))
    counts = starts.diff()
    rows = torch.arange(expert.numel(), device=expert.device)
    position = torch.empty_like(expert)
    if align == 1:  # no padding: groups start where their entries do, and an entry's row is its sorted place
        offsets = starts
        position[order] = rows
    else:
        offsets = F.pad(((counts + align - 1) // align * align).cumsum(0), (1, 0))
        position[order] = offsets[sorted_expert] + rows - starts[sorted_expert]  # padded start + rank in expert
    host_offsets = None
    if align > 1 or not x.is_cuda:
        host = torch.cat([starts[[0, -1]], offsets]).tolist()  # the one host sync
        if host[0] != 0 or host[1] != expert.numel():
            raise ValueError(f"topk_ids holds expert ids outside [0, num_experts={num_experts})")
        host_offsets = tuple(host[2:])
    return position.view(topk_ids.shape), counts, offsets, host_offsets


def padding_rows(position: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows of an `[num_rows, H]` grouped tensor that no (token, slot) of `position` maps to, in
    increasing order. No host sync: their number is num_rows - position.numel()."""
    covered = torch.zeros(num_rows, dtype=torch.uint8, device=position.device)
    covered[position.reshape(-1)] = 1
    return torch.sort(covered, stable=True).indices[: num_rows - position.numel()]  # zeros first


def permute_rows(x: torch.Tensor, position: torch.Tensor, num_rows: int) -> torch.Tensor:
    """x [T, H] -> [num_rows, H]: row position[t, j] holds a copy of x[t]; a position of -1 makes
    no copy (expert parallelism's slots served on another rank). Rows no position names are zeros
    on the reference path and left unwritten by the kernel, so a caller must not read them
    (expert parallelism's buffer rows past those its routing filled). Backward: each token's row
    gets the sum of its copies' gradients."""
    if use_triton(x):
        return _PermuteRows.apply(x, position, num_rows, False)
    return permute_rows_reference(x, position, num_rows)


def permute_rows_reference(x: torch.Tensor, position: torch.Tensor, num_rows: int) -> torch.Tensor:
    copies = x.repeat_interleave(position.shape[1], dim=0)  # [T*k, H] in (token, slot) order
    position = position.reshape(-1)
    copied = position >= 0  # -1: no copy
    if not bool(copied.all()):
        position, copies = position[copied], copies[copied]
    return x.new_zeros(num_rows, x.shape[1]).index_copy(0, position, copies)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, position, num_rows, zero_unnamed):
        ctx.save_for_backward(position)
        return permute_rows_triton(x, position, num_rows, zero_unnamed)

    @staticmethod
    def backward(ctx, grad_grouped):
        (position,) = ctx.saved_tensors
        return unpermute_sum_triton(grad_grouped, position), None, None, None


def permute_rows_triton(
    x: torch.Tensor, position: torch.Tensor, num_rows: int, zero_unnamed: bool = True
) -> torch.Tensor:
    x, position = x.contiguous(), position.contiguous()
    num_tokens, hidden = x.shape
    grouped = x.new_empty(num_rows, hidden)
    if num_rows > position.numel() and zero_unnamed:
        grouped.index_fill_(0, padding_rows(position, num_rows), 0)
    if x.numel() > 0 and position.numel() > 0:  # a launch grid must not be empty
        block = block_size(hidden)
        grid = (num_tokens, triton.cdiv(hidden, block))
        _permute_rows_kernel[grid](x, position, grouped, hidden, position.shape[1], BLOCK_H=block)
    return grouped


def unpermute_sum_triton(grad_grouped: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """grad_x[t] = sum_j grad_grouped[position[t, j]], accumulated in fp32."""
    grad_grouped, position = grad_grouped.contiguous(), position.contiguous()
    num_tokens, k = position.shape
    hidden = grad_grouped.shape[1]
    grad_x = grad_grouped.new_empty(num_tokens, hidden)
    if grad_x.numel() > 0:
        block = block_size(hidden)
        grid = (num_tokens, triton.cdiv(hidden, block))
        _unpermute_sum_kernel[grid](grad_grouped, position, grad_x, hidden, k, BLOCK_H=block)
    return grad_x


@triton.jit
def _permute_rows_kernel(x_ptr, position_ptr, grouped_ptr, hidden, k, BLOCK_H: tl.constexpr):
    # One program per (token, column tile): read the token's tile once, write it k times.
    token = tl.program_id(0).to(tl.int64)  # 64-bit: row * hidden can pass 2**31
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    tile = tl.load(x_ptr + token * hidden + cols, mask=mask)
    for j in range(k):
        row = tl.load(position_ptr + token * k + j).to(tl.int64)
        tl.store(grouped_ptr + row * hidden + cols, tile, mask=mask & (cols * 0 + row >= 0))  # -1: no copy


@triton.jit
def _unpermute_sum_kernel(grad_grouped_ptr, position_ptr, grad_x_ptr, hidden, k, BLOCK_H: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in range(k):
        row = tl.load(position_ptr + token * k + j).to(tl.int64)
        read = mask & (cols * 0 + row >= 0)  # -1: no copy, no gradient
        acc += tl.load(grad_grouped_ptr + row * hidden + cols, mask=read, other=0.0).to(tl.float32)
    tl.store(grad_x_ptr + token * hidden + cols, acc.to(grad_x_ptr.dtype.element_ty), mask=mask)
