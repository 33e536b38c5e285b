"""A tensor-parallel layer's partial output summed over the ranks inside the residual add and the
RMSNorm after it: one kernel where there were three (decoding under tensor parallelism).

Under TP a decoder layer's attention and MoE block each end in a partial sum that every rank must
add up (`parallel/comm.py`'s all-reduce), and what a decode step does next with that sum is the
residual add and an RMSNorm (`rms_norm.add_rms_norm`). So the engine's layers (`run_layers`, in
`sums_left_to_norms`) leave each such sum to the norm that follows it: `comm` hands the partial
over (`leave`) instead of summing it, and `add_summed_rms_norm` takes it.

Where the ranks map common memory (PyTorch's symmetric memory, without NVLink multicast), the
sum is in the norm's kernel, a program a block of rows. The rows are their own signal
(TensorRT-LLM's "Lamport" one-shot): every slot of every rank's buffer holds EMPTY (-0.0) until a
rank's rows land in it. Each program writes its rows of the partial, -0.0 made +0.0 (the fp32 sum,
from +0.0, is the same either way), into its own slot of every rank's buffer, polls its slots at
its own rank until no element is EMPTY, adds them in rank order in fp32 and rounds once -- every
rank gets the same bits -- empties them again, and adds the residual and normalises as
`add_rms_norm` does. No flag and no fence: one crossing of NVLink a sum. The buffer has two
halves, by the parity of each program's count of its meetings (kept at its rank; nothing is reset,
so a CUDA graph replays it): a half emptied at a program's meeting m is written again at m + 2,
which a rank reaches only after it has read every rank's rows of m + 1 -- written in a launch after
the whole of m. That is a one-shot all-reduce inside the norm's kernel and inside the chain of
dependent launches (`ops/backend.py`), which PyTorch's all-reduce kernel ends twice a layer.
On H200s, meeting by flags (each program raising a flag at every rank after a fence and waiting for
every rank's) took a decode step's sum, add and norm to 4.0 µs on two GPUs and 5.2 on four, where
the all-reduce and `add_rms_norm` took 8.0 and 8.3: the 48-layer Qwen3-30B-A3B shape's decode
step went 1.14x (TP=2) and 1.22x (TP=4) faster at batch 1. Meeting by values then took that step
2.62 -> 2.57 ms at batch 1 and 10.61 -> 10.49 at batch 64 on two H200s (whole experts: 10.41 ->
10.35), the same tokens, so the flags were removed (docs/benchmarks.md, 2026-11-28 and -29).
Elsewhere (a CPU, gloo, rows past what the buffer holds) the left sum is the all-reduce as before,
then `add_rms_norm`: the same ops in the same order.

Limits: the whole row in one tile; at most MAX_PROGRAMS blocks of rows (`PeerMemory.holds`); an
add that no norm follows takes the sum plainly (`settled`). A left sum that nothing takes is an
error, raised when the context closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moemesh.ops.backend import dependent_launch, tl, triton, wait_for_inputs
from moemesh.ops.rms_norm import add_rms_norm, fuses_add, normalised_rows, rms_norm_blocks

MAX_PROGRAMS = 256  # blocks of rows (of 2 rows at a width of 2048: 512 rows), a count of meetings each
EMPTY = -0.0  # what a slot of the buffer holds until a rank's rows land in it (`PeerMemory.emptied`)


@dataclass(frozen=True)
class PeerMemory:
    """What the kernel needs of the memory every rank of a group maps: the device address of a
    table (one entry a rank, in rank order) of the ranks' buffers ([2, world, capacity] each, of
    `dtype`, `emptied` at first), the address of this rank's counts of meetings (MAX_PROGRAMS int32
    zeros at first, its own memory), this rank's index and the rank count."""

    buffer_ptrs: int
    meetings_ptr: int
    rank: int
    world: int
    capacity: int
    dtype: torch.dtype

    @staticmethod
    def buffer_numel(world: int, capacity: int) -> int:
        if capacity % 16:
            raise ValueError(f"PeerMemory: a capacity of {capacity} elements, not a multiple of 16")
        return 2 * world * capacity  # two halves, by the parity of a meeting

    @staticmethod
    def emptied(buffer: torch.Tensor) -> torch.Tensor:
        """The buffer as the kernel expects it at first: every slot EMPTY."""
        return buffer.fill_(EMPTY)

    def holds(self, rows: torch.Tensor) -> bool:
        """Whether the kernel can sum these rows [..., width] here."""
        width = rows.shape[-1]
        blocks = triton.cdiv(rows.numel() // max(width, 1), rms_norm_blocks(width)[0])
        return rows.dtype == self.dtype and 0 < rows.numel() <= self.capacity and blocks <= MAX_PROGRAMS


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
    if left.peers is None or not fuses_add(h, delta, weight):  # (comm gives peers only where they hold delta)
        return add_rms_norm(h, left.summed().view_as(delta), weight, eps)
    return summed_add_rms_norm_triton(h, delta, weight, eps, left.peers)


def summed_add_rms_norm_triton(
    h: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor, eps: float, peers: PeerMemory
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + Σ_ranks partial, its RMSNorm) in one kernel over `peers` (every rank calls it, with
    rows that `peers.holds`)."""
    rows = h.contiguous().view(-1, h.shape[-1])
    n, width = rows.shape
    total, out = torch.empty_like(rows), rows.new_empty(n, width, dtype=torch.promote_types(weight.dtype, h.dtype))
    block_rows, block_w, warps = rms_norm_blocks(width)
    if n:
        _summed_add_rms_norm_kernel[(triton.cdiv(n, block_rows),)](
            partial.contiguous().view_as(rows), rows, total, weight.contiguous(), out, n, width, eps,
            peers.buffer_ptrs, peers.meetings_ptr, peers.rank, peers.capacity, WORLD=peers.world,
            BITS=8 * partial.element_size(),
            BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=warps,
            **dependent_launch(h),
        )  # fmt: skip
    return total.view(h.shape), out.view(h.shape)


@triton.jit
def _written(values, BITS: tl.constexpr):
    """values as a rank writes them into a slot: -0.0 (EMPTY) as +0.0, compared as bits (which
    Triton's interpreter does right for bf16, where it compares -0.0 and 0.0 as floats wrongly)."""
    empty: tl.constexpr = -(1 << (BITS - 1))
    if BITS == 16:
        bits = values.to(tl.int16, bitcast=True)
    else:
        bits = values.to(tl.int32, bitcast=True)
    return tl.where(bits == empty, tl.zeros_like(bits), bits).to(values.dtype, bitcast=True)


@triton.jit
def _read_and_empty(slot, mask, BITS: tl.constexpr):
    """A rank's rows from this rank's slot, once every element has landed (none EMPTY), in fp32;
    the slot EMPTY again after."""
    empty: tl.constexpr = -(1 << (BITS - 1))  # -0.0's bits, compared as bits: -0.0 == 0.0 as floats
    if BITS == 16:
        bits_at = slot.to(tl.pointer_type(tl.int16))
    else:
        bits_at = slot.to(tl.pointer_type(tl.int32))
    bits = tl.load(bits_at, mask=mask, other=0, volatile=True)
    while tl.sum((bits == empty).to(tl.int32)) > 0:
        bits = tl.load(bits_at, mask=mask, other=0, volatile=True)
    tl.store(bits_at, tl.full(bits.shape, empty, bits.dtype), mask=mask)
    return bits.to(slot.dtype.element_ty, bitcast=True).to(tl.float32)


@triton.jit(do_not_specialize=["rank"])  # one binary for every rank (Triton specialises an argument of 1)
def _summed_add_rms_norm_kernel(partial_ptr, h_ptr, total_ptr, weight_ptr, out_ptr, n, width, eps,
                                buffer_ptrs, meetings_ptr, rank, capacity, WORLD: tl.constexpr,
                                BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                                GDC: tl.constexpr):  # fmt: skip
    wait_for_inputs(GDC)
    program = tl.program_id(0)
    rows = program * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)  # 64-bit: rows * width
    cols = tl.arange(0, BLOCK_W)
    mask = (rows < n)[:, None] & (cols < width)[None, :]
    offsets = rows[:, None] * width + cols[None, :]
    meetings = meetings_ptr.to(tl.pointer_type(tl.int32)) + program  # this program's count, at this rank
    meeting = tl.load(meetings) + 1
    half = tl.multiple_of((meeting & 1).to(tl.int64) * WORLD * capacity, 16)  # capacity: a multiple of 16
    partial = _written(tl.load(partial_ptr + offsets, mask=mask), BITS)
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    for peer in tl.static_range(WORLD):  # this rank's rows into its slot of every rank's buffer
        buffer = tl.multiple_of(tl.load(buffers + peer).to(tl.pointer_type(partial_ptr.dtype.element_ty)), 16)
        tl.store(buffer + half + tl.multiple_of(rank * capacity, 16) + offsets, partial, mask=mask)
    own = tl.multiple_of(tl.load(buffers + rank).to(tl.pointer_type(partial_ptr.dtype.element_ty)), 16) + half
    summed = tl.zeros([BLOCK_ROWS, BLOCK_W], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # in rank order: the same bits on every rank
        summed += _read_and_empty(own + peer * capacity + offsets, mask, BITS)
    # Rounded as the all-reduce's result is, then the residual add, rounded as the add alone is.
    x = tl.load(h_ptr + offsets, mask=mask, other=0.0)
    x = (x.to(tl.float32) + summed.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(total_ptr + offsets, x, mask=mask)
    normalised_rows(x, cols, mask, offsets, width, eps, weight_ptr, out_ptr)
    tl.store(meetings, meeting)
