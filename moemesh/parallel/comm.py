"""Every collective moemesh issues goes through here: autograd-aware where gradients must flow
through it, and counted (calls and bytes per kind and phase) so tests can assert exactly what a
layer communicates, forward and backward — inside CUDA graphs too: a graph's capture issues
nothing, so what it recorded is taken out of the counters (`counted_apart`) and added back at each
replay (`recount`)."""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from moemesh.ops import invariant, recompute, summed_norm

calls: Counter[tuple[str, str]] = Counter()  # (kind, "forward" | "backward") -> number of calls
sent_bytes: Counter[tuple[str, str]] = Counter()  # the same key -> bytes this rank sent


def reset_counts() -> None:
    calls.clear()
    sent_bytes.clear()


def _count(kind: str, phase: str, nbytes: int) -> None:
    calls[(kind, phase)] += 1
    sent_bytes[(kind, phase)] += nbytes


Issued = tuple[Counter, Counter]  # (calls, sent_bytes) of one piece of work


def counted_apart(work: Callable[[], Any]) -> tuple[Any, Issued]:
    """Run `work` and return its result and the collectives it issued, those left out of the
    counters: a CUDA graph's capture runs nothing yet, its replays do (`recount`)."""
    before = calls.copy(), sent_bytes.copy()
    out = work()
    issued = calls - before[0], sent_bytes - before[1]
    for counter, saved in zip((calls, sent_bytes), before):
        counter.clear()
        counter.update(saved)
    return out, issued


def recount(issued: Issued) -> None:
    """Count the collectives of a replayed CUDA graph (`counted_apart` of its capture)."""
    calls.update(issued[0])
    sent_bytes.update(issued[1])


# ---- all-to-all -----------------------------------------------------------------------------------


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Rows of several tensors (any dtypes, same row count) side by side as one byte matrix, so
    that one all-to-all carries them all."""
    rows = tensors[0].shape[0]
    if len(tensors) == 1:  # no copy: the tensor's bytes as they are
        return tensors[0].contiguous().view(-1).view(torch.uint8).view(rows, _row_bytes(tensors[0]))
    # Flattened first: a [rows, 1] tensor can count as contiguous with a stride of 0, which a byte view refuses.
    return torch.cat([t.contiguous().view(-1).view(torch.uint8).view(rows, _row_bytes(t)) for t in tensors], dim=1)


def _unpack(packed: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    if len(like) == 1:  # the whole row: aligned as the buffer is
        return [packed.view(like[0].dtype).reshape(packed.shape[0], *like[0].shape[1:])]
    out, start = [], 0
    for t in like:
        width = _row_bytes(t)
        # Copied into a fresh buffer: the slice may start at, or stride by, a byte count that is
        # not aligned for t's dtype (and .contiguous() keeps a one-row slice as it is).
        piece = packed.new_empty(packed.shape[0], width).copy_(packed[:, start : start + width]).view(t.dtype)
        out.append(piece.reshape(packed.shape[0], *t.shape[1:]))
        start += width
    return out


def _row_bytes(t: torch.Tensor) -> int:
    return t.element_size() * int(torch.Size(t.shape[1:]).numel())


_in_flight: Callable[[], None] | None = None  # see `while_in_flight`


@contextlib.contextmanager
def while_in_flight(hook: Callable[[], None]):
    """Call `hook()` between launching each all-to-all or all-gather of rows (forward or backward
    direction) and waiting for it: the pipeline runs another chunk's work there
    (`pipeline/runtime.py`). A module global, not a thread-local: autograd may run backward
    functions on its own threads."""
    global _in_flight
    previous, _in_flight = _in_flight, hook
    try:
        yield
    finally:
        _in_flight = previous


def _all_to_all_bytes(
    packed: torch.Tensor, output_splits: list[int], input_splits: list[int], group, phase: str
) -> torch.Tensor:
    if phase == "forward":  # selective activation checkpointing keeps what arrived (`ops/recompute.py`)
        return recompute.kept(lambda: _all_to_all_now(packed, output_splits, input_splits, group, phase))
    return _all_to_all_now(packed, output_splits, input_splits, group, phase)


def _all_to_all_now(
    packed: torch.Tensor, output_splits: list[int], input_splits: list[int], group, phase: str
) -> torch.Tensor:
    out = packed.new_empty(sum(output_splits), packed.shape[1])
    _count("all_to_all", phase, packed.numel() * packed.element_size())
    return _landed(out, dist.all_to_all_single(out, packed, output_splits, input_splits, group=group, async_op=True))


def _landed(out: torch.Tensor, work) -> torch.Tensor:
    """`out` once the asynchronous collective `work` has filled it. NCCL runs it on its own
    stream; the compute stream waits at `wait`, right before the result is used, and whatever
    `_in_flight` queues meanwhile overlaps it."""
    if _in_flight is not None:
        _in_flight()
    work.wait()
    return out


def _moved(ctx, tensors: tuple[torch.Tensor, ...], move: Callable[[torch.Tensor], torch.Tensor]) -> tuple:
    """An autograd Function's forward: the tensors packed into one byte matrix, moved by the one
    collective `move`, unpacked; the integer ones marked as having no gradient."""
    ctx.differentiable = [t.is_floating_point() for t in tensors]
    outputs = _unpack(move(_pack(list(tensors))), list(tensors))
    for out, differentiable in zip(outputs, ctx.differentiable):
        if not differentiable:
            ctx.mark_non_differentiable(out)
    return tuple(outputs)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, output_splits, input_splits, group, *tensors):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        ctx.templates = [t.new_empty(0, *t.shape[1:]) for t in tensors]
        splits = (output_splits, input_splits)
        return _moved(ctx, tensors, lambda packed: _all_to_all_bytes(packed, *splits, group, "forward"))

    @staticmethod
    def backward(ctx, *grads):
        output_splits, input_splits = ctx.splits
        floats = [
            (g if g is not None else torch.zeros(sum(output_splits), *t.shape[1:], dtype=t.dtype, device=t.device))
            for g, t, d in zip(grads, ctx.templates, ctx.differentiable)
            if d
        ]
        received = _all_to_all_bytes(_pack(floats), input_splits, output_splits, ctx.group, "backward")
        unpacked = iter(_unpack(received, floats))
        return (None, None, None, *(next(unpacked) if d else None for d in ctx.differentiable))


def all_to_all(
    tensors: list[torch.Tensor], output_splits: list[int], input_splits: list[int], group
) -> list[torch.Tensor]:
    """Send rows [sum(input_splits[:p]), +input_splits[p]) of every tensor to rank p of `group`,
    receive output_splits[p] rows from each; all tensors travel in one message. Gradients of the
    floating-point tensors come back by the reverse all-to-all."""
    return list(_AllToAll.apply(output_splits, input_splits, group, *tensors))


# ---- rows of every rank, and their sums back (expert parallelism without host synchronisation) ------


def _gathered(packed: torch.Tensor, group, phase: str) -> torch.Tensor:
    out = packed.new_empty(dist.get_world_size(group) * packed.shape[0], packed.shape[1])
    _count("all_gather", phase, packed.numel() * packed.element_size())
    return _landed(out, dist.all_gather_into_tensor(out, packed.contiguous(), group=group, async_op=True))


def _summed_blocks(tensors: list[torch.Tensor], group, phase: str) -> list[torch.Tensor]:
    """Of each tensor's rows (ranks × T of them): block r from every rank, summed in fp32 on rank
    r. One all-to-all of equal blocks carries every tensor, then local sums that round once (a
    reduce-scatter would round at each hop of its ring)."""
    ranks, rows = dist.get_world_size(group), tensors[0].shape[0]
    splits = [rows // ranks] * ranks
    received = _unpack(_all_to_all_now(_pack(tensors), splits, splits, group, phase), tensors)
    return [
        t.view(ranks, rows // ranks, *t.shape[1:]).sum(0, dtype=torch.promote_types(t.dtype, torch.float32)).to(t.dtype)
        for t in received
    ]


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        # Kept by selective activation checkpointing, as the all-to-all's result is.
        return _moved(ctx, tensors, lambda packed: recompute.kept(lambda: _gathered(packed, group, "forward")))

    @staticmethod
    def backward(ctx, *grads):
        # (an output no loss used gets a zero gradient from autograd: materialize_grads)
        summed = iter(_summed_blocks([g for g, d in zip(grads, ctx.differentiable) if d], ctx.group, "backward"))
        return (None, *(next(summed) if d else None for d in ctx.differentiable))


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return recompute.kept(lambda: _summed_blocks([x], group, "forward")[0])

    @staticmethod
    def backward(ctx, grad):
        return _unpack(_gathered(_pack([grad]), ctx.group, "backward"), [grad])[0], None


def all_gather_rows(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Every rank's rows of each tensor (all with the same row count T on every rank), in rank
    order: [ranks × T, ...] each, all in one message. The gradient of a floating-point tensor's
    rows is the sum of the gradients its copies got on every rank."""
    return list(_AllGatherRows.apply(group, *tensors))


def reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """x [ranks × T, ...] on every rank -> [T, ...]: rank r gets the sum over ranks of their
    block r, accumulated in fp32 (the reverse of `all_gather_rows`)."""
    return _ReduceScatterRows.apply(x, group)


def exchange_sizes(sizes: torch.Tensor, group) -> torch.Tensor:
    """sizes[p] (a row of counts) goes to rank p; returns what every rank sent here, on the
    device: the caller copies it to the host together with its own counts, in one sync."""

    def exchange() -> torch.Tensor:
        out = torch.empty_like(sizes)
        _count("exchange_sizes", "forward", sizes.numel() * sizes.element_size())
        dist.all_to_all_single(out, sizes.contiguous(), group=group)
        return out

    return recompute.kept(exchange)


# ---- all-reduce -----------------------------------------------------------------------------------


def _summed(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    if phase == "forward":  # kept by selective activation checkpointing (`ops/recompute.py`)
        return recompute.kept(lambda: _summed_now(x, group, phase))
    return _summed_now(x, group, phase)


def _summed_now(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    _count("all_reduce", phase, x.numel() * x.element_size())
    return _sum_of(x, group, phase)


def _sum_of(x: torch.Tensor, group, phase: str) -> torch.Tensor:
    if phase == "forward" and invariant.on():
        return _summed_in_rank_order(x, group)
    peer = _peer_buffers.get(group)
    if peer is not None and (y := peer.summed(x)) is not None:
        return y
    y = x.contiguous().clone()
    dist.all_reduce(y, group=group)
    return y


def _summed_in_rank_order(x: torch.Tensor, group) -> torch.Tensor:
    """Batch-invariant mode's sum over the ranks: every rank's x gathered, then added in rank order
    in fp32 (or x's wider dtype) and rounded once. NCCL's ring and gloo split a sum by its size,
    so over three ranks or more an engine's step and the trainer's forward (other sizes) would
    add the same partial sums in other orders; this order is the same for any size, any layout,
    engine or trainer. (Two ranks' sum has one order: a + b = b + a.) The price is a gather of
    ranks × x instead of an all-reduce."""
    flat = x.contiguous().view(-1)
    gathered = flat.new_empty(dist.get_world_size(group) * flat.numel())
    dist.all_gather_into_tensor(gathered, flat, group=group)
    parts = gathered.view(-1, flat.numel())
    total = parts[0].to(torch.promote_types(x.dtype, torch.float32))
    for part in parts[1:]:
        total = total + part
    return total.to(x.dtype).view_as(x)


class _AllReduceSum(torch.autograd.Function):
    """y = Σ_ranks x. Every rank uses y, so the gradient of its x is the sum of all ranks'
    gradients of y."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _summed(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group, "backward"), None


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable sum over the ranks of `group` (a no-op for a one-rank group)."""
    return x if group is None else _AllReduceSum.apply(x, group)


# ---- all-reduce through peer memory (decoding) -----------------------------------------------------

# Bytes up to which a sum over a group with a peer buffer (`use_peer_all_reduce`) takes each way;
# larger tensors go through NCCL. One-shot's limit is for 2 ranks and halves as the ranks double
# (each rank reads every peer's whole tensor). The thresholds come from `bench/serve/decode.py
# --all-reduce` on 2 and 4 H200s (docs/benchmarks.md, issue 49: one-shot is the fastest up to 1 MB
# on 2, up to 512 KB on 4; two-shot then, NCCL from past 4 MB); a benchmark sets them to compare
# the ways.
PEER_ALL_REDUCE = {"one_shot": 1 << 20, "two_shot": 4 << 20}


class _PeerBuffer:
    """A buffer every rank of a group maps (PyTorch's symmetric memory) and the two sums over it
    that need no NVLink multicast: one-shot (each rank copies its tensor in, then reads every
    peer's and adds them: one kernel, lowest latency) and two-shot (a reduce-scatter, then an
    all-gather, through the same buffer: less traffic for larger tensors). Both add the ranks in
    rank order, so every rank gets the same sum, as with NCCL. Beside it, the buffer
    through which the norms of the engine's layers take their sums (`memory`, ops/summed_norm.py)."""

    def __init__(self, group, device: torch.device, dtype: torch.dtype, max_bytes: int):
        from torch.distributed import _symmetric_memory as symmetric_memory

        self.buffer = symmetric_memory.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symmetric_memory.rendezvous(self.buffer, group)
        self.group_name = group.group_name
        self.ranks = dist.get_world_size(group)
        # And the buffer of the sums in the norms' kernel (`ops/summed_norm.py`), of the tensors
        # one-shot sums, with this rank's counts of its programs' meetings.
        capacity = min(max_bytes, PEER_ALL_REDUCE["one_shot"] * 2 // self.ranks) // dtype.itemsize // 16 * 16
        pushed = symmetric_memory.empty(
            summed_norm.PeerMemory.buffer_numel(self.ranks, capacity), dtype=dtype, device=device
        )
        summed_norm.PeerMemory.emptied(pushed)
        meetings = torch.zeros(summed_norm.MAX_PROGRAMS, dtype=torch.int32, device=device)
        handle = symmetric_memory.rendezvous(pushed, group)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's slots empty before any rank's kernel writes into them
        self.kept = pushed, meetings  # alive as long as this: the kernel reaches them by address alone
        self.memory = summed_norm.PeerMemory(
            handle.buffer_ptrs_dev, meetings.data_ptr(), handle.rank, self.ranks, capacity, dtype
        )

    def _fits(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return x.dtype == self.buffer.dtype and nbytes % 16 == 0 and 0 < x.numel() <= self.buffer.numel()

    def one_shot(self, x: torch.Tensor) -> bool:
        return self._fits(x) and x.numel() * x.element_size() <= PEER_ALL_REDUCE["one_shot"] * 2 // self.ranks

    def summed(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the group, or None when x is not for this buffer (its dtype, a
        size past the thresholds or the buffer, or not a multiple of 16 bytes)."""
        if not self._fits(x):
            return None
        n, nbytes = x.numel(), x.numel() * x.element_size()
        flat, into = x.contiguous().view(-1), self.buffer[:n]
        if self.one_shot(x):
            return torch.ops.symm_mem.one_shot_all_reduce_copy(into, flat, "sum", self.group_name).view_as(x)
        if nbytes <= PEER_ALL_REDUCE["two_shot"]:
            into.copy_(flat)
            out = torch.empty_like(flat)
            return torch.ops.symm_mem.two_shot_all_reduce_out(into, "sum", self.group_name, out).view_as(x)
        return None


_peer_buffers: dict[Any, _PeerBuffer] = {}


def use_peer_all_reduce(group, device: torch.device, dtype: torch.dtype, max_bytes: int) -> bool:
    """From now on, sum the tensors of `dtype` up to `max_bytes` over `group` through a buffer
    every rank maps, not NCCL (collective: every rank of the group calls it). For decoding under
    tensor parallelism, where a step's all-reduces are of a few KB and their latency is the cost.
    False, and NCCL stays, where it cannot be: a CPU, a one-rank group, a PyTorch without
    symmetric memory; or where nothing would use it (`PEER_ALL_REDUCE` all zero)."""
    if group is None or device.type != "cuda" or dist.get_world_size(group) == 1 or not any(PEER_ALL_REDUCE.values()):
        return False
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return False
    if group not in _peer_buffers:
        _peer_buffers[group] = _PeerBuffer(group, device, dtype, max_bytes)
    return True


# ---- tensor-parallel regions (Megatron's f and g) --------------------------------------------------


class _ToShards(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group, "backward"), None


class _FromPartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _summed(x, group, "forward")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def to_shards(x: torch.Tensor, group) -> torch.Tensor:
    """f: a replicated x enters a region where each rank computes with its own shard of the
    weights, so each rank's gradient of x is a share of the whole: identity forward, all-reduce
    backward."""
    return x if group is None else _ToShards.apply(x, group)


# Whether a sum left to the norm after it (`ops/summed_norm.py`) is taken in the norm's kernel where
# a peer buffer serves one-shot sums (a decode step at batch 1 1.14-1.22x faster under TP on H200s);
# False: by the all-reduce as ever, then the add and norm's kernel (for measuring the difference).
SUMS_IN_NORMS = True


def from_partial(x: torch.Tensor, group) -> torch.Tensor:
    """g: each rank holds a partial sum of x; every rank then uses the full x alike, so each
    partial's gradient is the full gradient: all-reduce forward, identity backward. In the
    engine's layers (`summed_norm.sums_left_to_norms`) the sum is left to the residual add and
    norm that follow it: x itself comes back, handed over (`summed_norm.leave`)."""
    if group is None:
        return x
    if summed_norm.leaving():
        _count("all_reduce", "forward", x.numel() * x.element_size())
        return summed_norm.leave(x, lambda: _sum_of(x, group, "forward"), _norm_peers(x, group))
    return _FromPartial.apply(x, group)


def _norm_peers(x: torch.Tensor, group) -> summed_norm.PeerMemory | None:
    """The peer buffer in which the norm's kernel can sum x, if any (never in batch-invariant
    mode: its sum is `_summed_in_rank_order`'s)."""
    peer = _peer_buffers.get(group)
    if not SUMS_IN_NORMS or invariant.on() or peer is None or not peer.one_shot(x) or not peer.memory.holds(x):
        return None
    return peer.memory


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    """Elementwise max over `group`, not differentiable (the shift that stabilises a softmax)."""
    y = x.detach().clone()
    _count("all_reduce_max", "forward", y.numel() * y.element_size())
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=group)
    return y


def all_reduce_sum_(tensors: list[torch.Tensor], group, kind: str = "all_reduce") -> None:
    """Sum tensors in place over `group`, flattened into one buffer so it is one collective.
    Not differentiable: for gradients after backward and for statistics."""
    if group is None:
        return
    for dtype in sorted({t.dtype for t in tensors}, key=str):
        same = [t for t in tensors if t.dtype == dtype]
        flat = torch.cat([t.reshape(-1) for t in same])
        _count(kind, "step", flat.numel() * flat.element_size())
        dist.all_reduce(flat, group=group)
        for t, piece in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(piece.view_as(t))


class _AllGather(torch.autograd.Function):
    """Every rank's x side by side. Every rank then computes the same from the whole (the logits
    of a vocabulary-split head), so each x's gradient is its own slice of the whole's."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        _count("all_gather", "forward", x.numel() * x.element_size())
        dist.all_gather(pieces, x.contiguous(), group=group)
        return torch.cat(pieces, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)], None, None


def all_gather(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Every rank's x, concatenated along `dim` in rank order (generation gathers the logits of
    the last position, split by vocabulary; batch-invariant scoring all of them). Differentiable
    where every rank goes on with the same whole."""
    return x if group is None else _AllGather.apply(x, group, dim)


def broadcast_(x: torch.Tensor, group) -> torch.Tensor:
    """x of the group's first rank copied into x on every rank, in place; not differentiable (a
    tensor-parallel server's other ranks receive each step's inputs from the one that serves)."""
    if group is None:
        return x
    _count("broadcast", "forward", x.numel() * x.element_size())
    dist.broadcast(x, src=dist.get_global_rank(group, 0), group=group)
    return x


# ---- point to point (pipeline stages) ------------------------------------------------------------


def send(tensors: list[torch.Tensor], dst: int, group) -> list:
    """Start sending tensors to global rank `dst` (of `group`) and return at once; wait on the
    returned handles (which keep the tensors alive) before reusing them. Sends and receives
    between two ranks match in order."""
    tensors = [t.contiguous() for t in tensors]
    for t in tensors:
        _count("send", "step", t.numel() * t.element_size())
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst, group) for t in tensors])
    return [(work, tensors) for work in works]


def recv(shapes: list[tuple[tuple[int, ...], torch.dtype]], src: int, group, device) -> list[torch.Tensor]:
    """Receive tensors of the given (shape, dtype) from global rank `src`, in the order sent."""
    tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src, group) for t in tensors]):
        work.wait()
    return tensors


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    """Wait for every rank of the default group (no-op without one)."""
    if _in_group():
        _count("barrier", "step", 0)
        dist.barrier()


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's `value` (any picklable object), in rank order, over the default group; [value]
    without one. For small host-side results that every rank must agree on (checkpoint checksums)."""
    if not _in_group():
        return [value]
    values = [None] * dist.get_world_size()
    _count("all_gather_object", "step", 0)
    dist.all_gather_object(values, value)
    return values


# ---- when a peer fails ----------------------------------------------------------------------------

# gloo raises a bare RuntimeError whose text starts with the C++ source location:
# "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 300000ms for recv operation ..."
_GLOO_LOCATION = re.compile(r"^\[[^\]]*/gloo/[^\]]*\]\s*")


def peer_failure(error: BaseException) -> str | None:
    """What a collective that failed says, in one line, when `error` comes from the communication
    backend (a peer that stopped, died or timed out); None for any other error."""
    text = str(error).strip()
    if isinstance(error, dist.DistError):
        reason = text
    elif isinstance(error, RuntimeError) and _GLOO_LOCATION.match(text):
        reason = _GLOO_LOCATION.sub("", text)
    else:
        return None
    # The first sentence of the first line: gloo and NCCL follow it with generic advice.
    first = reason.splitlines()[0] if reason else type(error).__name__
    return re.split(r"\.\s+(?=[A-Z])", first)[0].rstrip(".")
