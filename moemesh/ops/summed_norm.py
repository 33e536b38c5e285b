"""A tensor-parallel layer's partial output summed over the ranks inside the residual add and the
RMSNorm after it: one kernel where there were three (decoding under tensor parallelism).

Under TP a decoder layer's attention and MoE block each end in a partial sum that every rank must
add up (`parallel/comm.py`'s all-reduce), and what a decode step does next with that sum is the
residual add and an RMSNorm (`rms_norm.add_rms_norm`). So the engine's layers (`run_layers`, in
`sums_left_to_norms`) leave each such sum to the norm that follows it: `comm` hands the partial
over (`leave`) instead of summing it, and `add_summed_rms_norm` takes it.

Where the ranks map a common buffer (PyTorch's symmetric memory, without NVLink multicast), the
sum is in the norm's kernel: each program copies its rows of the partial into this rank's buffer,
meets the programs of the same index on the other ranks at a barrier of flags in that memory
(compare-and-swap at system scope; each flag is reset by the one that waits on it, so a CUDA graph
can replay it), reads every rank's rows, adds them in rank order in fp32 and rounds once -- every
rank gets the same bits -- then adds the residual and normalises as `add_rms_norm` does, and meets
its peers once more so that no rank writes its buffer again before all have read it. That is the
one-shot all-reduce's exchange, inside the norm's kernel and inside the chain of dependent
launches (`ops/backend.py`), which PyTorch's all-reduce kernel ends twice a layer. Elsewhere (a
CPU, gloo, a partial too large for the buffer) the left sum is the all-reduce as before, then
`add_rms_norm`: the same ops in the same order.

Limits: the whole row in one tile; at most MAX_PROGRAMS programs (each holds a flag per rank in
every rank's signal pad); an add that no norm follows takes the sum plainly (`settled`). A left
sum that nothing takes is an error, raised when the context closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moemesh.ops.backend import dependent_launch, tl, triton, use_triton, wait_for_inputs
from moemesh.ops.rms_norm import add_rms_norm, normalised_rows, rms_norm_blocks

MAX_PROGRAMS = 128


@dataclass(frozen=True)
class PeerMemory:
    """What the kernel needs of a buffer every rank of a group maps: device addresses of tables
    (one entry a rank, in rank order) of the ranks' buffers and of their signal pads, this rank's
    index, the rank count, and the buffer's size and dtype."""

    buffer_ptrs: int
    signal_pad_ptrs: int
    rank: int
    world: int
    numel: int
    dtype: torch.dtype


@dataclass
class _LeftSum:
    partial: torch.Tensor
    summed: Callable[[], torch.Tensor]  # the all-reduce, as it would have run
    peers: PeerMemory | None  # where the norm's kernel can sum it itself


_leaving = False
_left: _LeftSum | None = None


@contextlib.contextmanager
def sums_left_to_norms():
    """Within it (and without gradients), a tensor-parallel partial sum is left to the next
    `add_summed_rms_norm` (`leave`). Every left sum must be taken before it closes."""
    global _leaving, _left
    _leaving, failed = True, True
    try:
        yield
        failed = False
    finally:
        left, _leaving, _left = _left, False, None
        if left is not None and not failed:
            raise RuntimeError("a partial sum over the ranks was left to a norm, and no norm took it")


def leaving() -> bool:
    return _leaving and not torch.is_grad_enabled()


def leave(partial: torch.Tensor, summed: Callable[[], torch.Tensor], peers: PeerMemory | None) -> torch.Tensor:
    """Hand `partial` to the next `add_summed_rms_norm` (which calls `summed()`, the all-reduce,
    or sums it in its own kernel over `peers`); returns partial itself."""
    global _left
    if _left is not None:
        raise RuntimeError("a partial sum over the ranks was left to a norm, and the next one was left before it")
    _left = _LeftSum(partial, summed, peers)
    return partial


def _take(delta: torch.Tensor | None) -> _LeftSum | None:
    global _left
    if _left is None or delta is None:
        return None
    left = _left
    if left.partial.data_ptr() != delta.data_ptr() or left.partial.numel() != delta.numel():
        raise RuntimeError("a partial sum over the ranks was left to a norm, and another tensor reached it")
    _left = None
    return left


def settled(delta: torch.Tensor | None) -> torch.Tensor | None:
    """delta, summed over the ranks if it is a left sum (an add that no norm follows)."""
    left = _take(delta)
    return delta if left is None else left.summed().view_as(delta)


def add_summed_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm.add_rms_norm(h, delta, ...)`, delta first summed over the ranks if it is a left
    sum -- in the same kernel where the ranks map a buffer for it."""
    left = _take(delta)
    if left is None:
        return add_rms_norm(h, delta, weight, eps)
    peers = left.peers
    if (
        peers is None
        or not use_triton(h)
        or delta.shape != h.shape
        or delta.dtype != h.dtype
        or delta.dtype != peers.dtype
        or delta.numel() > peers.numel
        or weight.shape != h.shape[-1:]
    ):
        return add_rms_norm(h, left.summed().view_as(delta), weight, eps)
    return summed_add_rms_norm_triton(h, delta, weight, eps, peers)


def summed_add_rms_norm_triton(
    h: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor, eps: float, peers: PeerMemory
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + Σ_ranks partial, its RMSNorm) in one kernel over `peers` (every rank calls it)."""
    rows = h.contiguous().view(-1, h.shape[-1])
    n, width = rows.shape
    total, out = torch.empty_like(rows), rows.new_empty(n, width, dtype=torch.promote_types(weight.dtype, h.dtype))
    block_rows, block_w, warps = rms_norm_blocks(width)
    programs = min(triton.cdiv(n, block_rows), MAX_PROGRAMS)
    if n:
        _summed_add_rms_norm_kernel[(programs,)](
            partial.contiguous().view_as(rows), rows, total, weight.contiguous(), out, n, width, eps,
            peers.buffer_ptrs, peers.signal_pad_ptrs, peers.rank, WORLD=peers.world,
            BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=warps, **dependent_launch(h),
        )  # fmt: skip
    return total.view(h.shape), out.view(h.shape)


@triton.jit
def _meet_peers(signal_pad_ptrs, slot, rank, WORLD: tl.constexpr):
    """This program and those of the same index on every rank wait for each other: each raises
    its flag (slot, rank) in every rank's signal pad (release: its writes before it), then takes
    down the flag of every rank in its own (acquire: their writes after it). A flag still up
    from the last meeting is waited out, so meetings may follow each other back to back."""
    pads = signal_pad_ptrs.to(tl.pointer_type(tl.uint64))
    tl.debug_barrier()  # every thread's writes done before the flag goes up
    for peer in tl.static_range(WORLD):
        flag = tl.load(pads + peer).to(tl.pointer_type(tl.int32)) + slot * WORLD + rank
        while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
            pass
    own = tl.load(pads + rank).to(tl.pointer_type(tl.int32)) + slot * WORLD
    for peer in tl.static_range(WORLD):
        while tl.atomic_cas(own + peer, 1, 0, sem="acquire", scope="sys") != 1:
            pass
    tl.debug_barrier()


@triton.jit
def _summed_add_rms_norm_kernel(partial_ptr, h_ptr, total_ptr, weight_ptr, out_ptr, n, width, eps,
                                buffer_ptrs, signal_pad_ptrs, rank, WORLD: tl.constexpr,
                                BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    wait_for_inputs(GDC)
    program, programs = tl.program_id(0), tl.num_programs(0)
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    cols = tl.arange(0, BLOCK_W)
    blocks = tl.cdiv(n, BLOCK_ROWS)
    own = tl.load(buffers + rank).to(tl.pointer_type(partial_ptr.dtype.element_ty))
    for block in range(program, blocks, programs):  # this rank's partial rows into its buffer
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)  # 64-bit: rows * width
        mask = (rows < n)[:, None] & (cols < width)[None, :]
        offsets = rows[:, None] * width + cols[None, :]
        tl.store(own + offsets, tl.load(partial_ptr + offsets, mask=mask), mask=mask)
    _meet_peers(signal_pad_ptrs, program, rank, WORLD)
    for block in range(program, blocks, programs):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)  # 64-bit: rows * width
        mask = (rows < n)[:, None] & (cols < width)[None, :]
        offsets = rows[:, None] * width + cols[None, :]
        summed = tl.zeros([BLOCK_ROWS, BLOCK_W], dtype=tl.float32)
        for peer in tl.static_range(WORLD):  # in rank order: the same bits on every rank
            buffer = tl.load(buffers + peer).to(tl.pointer_type(partial_ptr.dtype.element_ty))
            summed += tl.load(buffer + offsets, mask=mask, other=0.0).to(tl.float32)
        # Rounded as the all-reduce's result is, then the residual add, rounded as the add alone is.
        x = tl.load(h_ptr + offsets, mask=mask, other=0.0)
        x = (x.to(tl.float32) + summed.to(x.dtype).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + offsets, x, mask=mask)
        normalised_rows(x, cols, mask, offsets, width, eps, weight_ptr, out_ptr)
    _meet_peers(signal_pad_ptrs, program, rank, WORLD)  # every rank has read the buffers
