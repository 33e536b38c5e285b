"""A tensor-parallel layer's partial output summed over the ranks inside the residual add and the
RMSNorm after it: one kernel where there were three (decoding under tensor parallelism).

Under TP a decoder layer's attention and MoE block each end in a partial sum that every rank must
add up (`parallel/comm.py`'s all-reduce), and what a decode step does next with that sum is the
residual add and an RMSNorm (`rms_norm.add_rms_norm`). So the engine's layers (`run_layers`, in
`sums_left_to_norms`) leave each such sum to the norm that follows it: `comm` hands the partial
over (`leave`) instead of summing it, and `add_summed_rms_norm` takes it.

Where the ranks map common memory (PyTorch's symmetric memory, without NVLink multicast), the
sum is in the norm's kernel, a program a block of rows: each program writes its rows of the
partial into every rank's buffer (its own slot there), raises its flag at every rank and waits for
every rank's flag at its own (atomics at system scope, all ranks at once, a thread each), then
reads every rank's rows from its own memory, adds them in rank order in fp32 and rounds once --
every rank gets the same bits -- and adds the residual and normalises as `add_rms_norm` does. The
flags are counters, and each program keeps the count of its meetings: nothing is reset, so a CUDA
graph replays it. The buffer has two halves, by the parity of that count, so one meeting a launch
is enough: a rank writes a half again only after every rank has begun the launch that follows the
one that read it. That is a one-shot all-reduce inside the norm's kernel and inside the chain of
dependent launches (`ops/backend.py`), which PyTorch's all-reduce kernel ends twice a layer. On
H200s a decode step's sum, add and norm took 4.0 µs on two GPUs and 5.2 on four, where the
all-reduce and `add_rms_norm` took 8.0 and 8.3; the 48-layer Qwen3-30B-A3B shape's decode step at
batch 1 went 1.14x (TP=2) and 1.22x (TP=4) faster, at batch 64 1.05x and 1.02x (docs/benchmarks.md,
2026-11-28). Flags of PyTorch's kind (compare-and-swap, a rank at a time, a meeting before and one
after the reads) were slower than the two kernels: 9.5 and 17.1 µs.
With `MEET_BY_VALUES` the rows are their own signal (TensorRT-LLM's "Lamport" one-shot): a slot
holds EMPTY (-0.0) until a rank's rows land in it, each rank writes its rows with -0.0 made +0.0
(the fp32 sum, from +0.0, is the same either way), polls its own slots until no element is EMPTY,
and empties them again after it has read them. No flag, and no fence before one: one crossing of
NVLink a sum where the flags take a write, a fence (which waits for the writes' acknowledgement)
and the flag's own write. Its two halves are the buffer's third and fourth (the flags' leave
their rows behind, which would read as landed), chosen by the same count: a half emptied at a
program's meeting m is written again at m + 2 or later, which a rank reaches only after every
rank's meeting m + 1 (either way) -- a later launch, after the whole of m. Checked on one H200
with 2 and 4 ranks as concurrent streams (tests/test_ops_summed_norm.py; 2026-11-28, before its
halves were split from the flags'); not yet timed on several GPUs: False (the flags) stays the
default until `bench/decode.py --step-variants by-values` measures it there.
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

MAX_PROGRAMS = 256  # blocks of rows (of 2 rows at a width of 2048: 512 rows), a flag each
# The rows as their own signal, EMPTY marking a slot not yet written (see the module docstring).
MEET_BY_VALUES = False
EMPTY = -0.0  # what every slot of the buffer holds at first (`PeerMemory.emptied`)


@dataclass(frozen=True)
class PeerMemory:
    """What the kernel needs of the memory every rank of a group maps: device addresses of tables
    (one entry a rank, in rank order) of the ranks' buffers ([4, world, capacity] each, of
    `dtype`) and of their flags (`flags_numel(world)` int32 zeros, at first), this rank's index
    and the rank count."""

    buffer_ptrs: int
    flag_ptrs: int
    rank: int
    world: int
    capacity: int
    dtype: torch.dtype

    @staticmethod
    def buffer_numel(world: int, capacity: int) -> int:
        if capacity % 16:
            raise ValueError(f"PeerMemory: a capacity of {capacity} elements, not a multiple of 16")
        return 4 * world * capacity  # two halves meeting by flags, two by values

    @staticmethod
    def flags_numel(world: int) -> int:
        # a flag a (program, rank), each program's meetings, and of them those by flags
        return MAX_PROGRAMS * (world + 2)

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
            peers.buffer_ptrs, peers.flag_ptrs, peers.rank, peers.capacity, WORLD=peers.world,
            MEETINGS=MAX_PROGRAMS * peers.world, PROGRAMS=MAX_PROGRAMS, BY_VALUES=MEET_BY_VALUES,
            BITS=8 * partial.element_size(),
            BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=warps,
            **dependent_launch(h),
        )  # fmt: skip
    return total.view(h.shape), out.view(h.shape)


@triton.jit
def _meet_peers(flag_ptrs, program, rank, meeting, WORLD: tl.constexpr):
    """This program and those of the same index on every rank wait for each other, for the
    `meeting`-th time: each adds one to its flag (program, rank) at every rank (release: its
    writes before it), then waits until the flag of every rank at its own reads `meeting`
    (acquire: their writes after it)."""
    tables = flag_ptrs.to(tl.pointer_type(tl.uint64))
    theirs = tl.load(tables + tl.arange(0, WORLD)).to(tl.pointer_type(tl.int32)) + program * WORLD + rank
    mine = tl.load(tables + rank).to(tl.pointer_type(tl.int32)) + program * WORLD
    tl.debug_barrier()  # every thread's writes done before the flags go up
    tl.atomic_add(theirs, 1, sem="release", scope="sys")  # to every rank at once
    for peer in tl.static_range(WORLD):  # a difference: right across the counters' wrap
        while tl.atomic_add(mine + peer, 0, sem="acquire", scope="sys") - meeting < 0:
            pass
    tl.debug_barrier()


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
                                buffer_ptrs, flag_ptrs, rank, capacity, WORLD: tl.constexpr,
                                MEETINGS: tl.constexpr, PROGRAMS: tl.constexpr, BY_VALUES: tl.constexpr,
                                BITS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                                GDC: tl.constexpr):  # fmt: skip
    wait_for_inputs(GDC)
    program = tl.program_id(0)
    rows = program * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)  # 64-bit: rows * width
    cols = tl.arange(0, BLOCK_W)
    mask = (rows < n)[:, None] & (cols < width)[None, :]
    offsets = rows[:, None] * width + cols[None, :]
    # This program's meetings so far, kept after the flags in this rank's own table.
    count = tl.load(flag_ptrs.to(tl.pointer_type(tl.uint64)) + rank).to(tl.pointer_type(tl.int32)) + MEETINGS + program
    meeting = tl.load(count) + 1
    buffers = buffer_ptrs.to(tl.pointer_type(tl.uint64))
    half = (meeting & 1).to(tl.int64) + (2 if BY_VALUES else 0)  # the flags' halves, or the values'
    half = tl.multiple_of(half * WORLD * capacity, 16)  # capacity: a multiple of 16
    partial = tl.load(partial_ptr + offsets, mask=mask)
    if BY_VALUES:  # -0.0 is EMPTY: written as +0.0
        partial = tl.where(partial == 0.0, tl.zeros_like(partial), partial)
    for peer in tl.static_range(WORLD):  # this rank's rows into its slot of every rank's buffer
        buffer = tl.multiple_of(tl.load(buffers + peer).to(tl.pointer_type(partial_ptr.dtype.element_ty)), 16)
        tl.store(buffer + half + tl.multiple_of(rank * capacity, 16) + offsets, partial, mask=mask)
    if not BY_VALUES:  # the flags count only the meetings by flags (the ways may change between launches)
        flagged = count + PROGRAMS
        flag_meeting = tl.load(flagged) + 1
        _meet_peers(flag_ptrs, program, rank, flag_meeting, WORLD)
        tl.store(flagged, flag_meeting)
    own = tl.multiple_of(tl.load(buffers + rank).to(tl.pointer_type(partial_ptr.dtype.element_ty)), 16) + half
    summed = tl.zeros([BLOCK_ROWS, BLOCK_W], dtype=tl.float32)
    for peer in tl.static_range(WORLD):  # in rank order: the same bits on every rank
        rows_of_peer = own + peer * capacity + offsets
        if BY_VALUES:
            summed += _read_and_empty(rows_of_peer, mask, BITS)
        else:
            summed += tl.load(rows_of_peer, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    # Rounded as the all-reduce's result is, then the residual add, rounded as the add alone is.
    x = tl.load(h_ptr + offsets, mask=mask, other=0.0)
    x = (x.to(tl.float32) + summed.to(x.dtype).to(tl.float32)).to(x.dtype)
    tl.store(total_ptr + offsets, x, mask=mask)
    normalised_rows(x, cols, mask, offsets, width, eps, weight_ptr, out_ptr)
    tl.store(count, meeting)
