"""ops/summed_norm.py: a tensor-parallel partial sum left to the residual add and norm after it.

The kernel is checked here on one rank (interpreted on CPU, compiled on a GPU): its buffer table,
its meetings at the signal pad and its sum of one rank's rows are all there, and one rank's sum is
the partial itself, so the result must be `add_rms_norm`'s kernel's bit for bit, in fp32 and bf16
(the same conversions in the same order); each launch must count one meeting a program and write
the rows into the half of the buffer of that count's parity (or, meeting by values, leave that half
EMPTY again). Several ranks run on one GPU as concurrent streams, each its own buffer and flags in
that GPU's memory: both ways of meeting give the rank-order sum of every rank's rows, launch after
launch, bit for bit (in a subprocess with a time limit: a meeting that never ends hangs its GPU).
On several GPUs `bench/decode.py --all-reduce` checks the kernel against the all-reduce followed
by `add_rms_norm`, bit for bit. The hand-over itself runs on CPU under gloo in every tensor-parallel
generation test (tests/test_parallel_generate.py, test_parallel_serve.py), where each left sum is
the all-reduce as before.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moemesh.ops import summed_norm
from moemesh.ops.rms_norm import add_rms_norm, rms_norm_blocks

EPS = 1e-6


def _ranks(world: int, dtype: torch.dtype, capacity: int, device=None):
    """PeerMemory of `world` ranks over buffers and flags of this process, one a rank (kept alive
    by the returned tuple)."""
    device = device or torch.get_default_device()
    buffers = [
        summed_norm.PeerMemory.emptied(
            torch.empty(summed_norm.PeerMemory.buffer_numel(world, capacity), dtype=dtype, device=device)
        )
        for _ in range(world)
    ]
    flags = [
        torch.zeros(summed_norm.PeerMemory.flags_numel(world), dtype=torch.int32, device=device) for _ in range(world)
    ]
    tables = torch.tensor([[t.data_ptr() for t in buffers], [t.data_ptr() for t in flags]], device=device)
    peers = [
        summed_norm.PeerMemory(tables[0].data_ptr(), tables[1].data_ptr(), rank, world, capacity, dtype)
        for rank in range(world)
    ]
    return peers, (buffers, flags, tables)


@pytest.mark.parametrize("by_values", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (5, 130), (300, 64), (600, 1024)])
def test_the_kernel_on_one_rank_is_the_add_and_norm(triton_kernels, monkeypatch, shape, dtype, by_values):
    monkeypatch.setattr(summed_norm, "MEET_BY_VALUES", by_values)
    capacity = 300 * 2048
    [peers], ([buffer], [flags], _) = _ranks(1, dtype, capacity)
    h, partial = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    assert peers.holds(partial)
    programs = -(-shape[0] // rms_norm_blocks(shape[-1])[0])  # a block of rows each
    with torch.no_grad():
        want_total, want_out = add_rms_norm(h, partial, weight, EPS)
        for meeting in (1, 2, 3):  # one half of the buffer, then the other, then the first again
            total, out = summed_norm.summed_add_rms_norm_triton(h, partial, weight, EPS, peers)
            assert torch.equal(total, want_total) and torch.equal(out, want_out)
            # Each program's flag at this (the one) rank counts its meetings, as does its count of
            # them and its count of those by flags (meeting by values: the count alone).
            most = summed_norm.MAX_PROGRAMS
            flagged = 0 if by_values else meeting
            for region, value in enumerate((flagged, meeting, flagged)):
                at = flags[region * most : (region + 1) * most]
                assert (at[:programs] == value).all() and not at[programs:].any()
            if by_values:  # read, and EMPTY again: every slot
                assert (_bits(buffer) == _bits(torch.tensor([summed_norm.EMPTY], dtype=dtype))).all()
            else:  # this rank's rows, in that meeting's half of the flags' two
                assert torch.equal(buffer.view(4, capacity)[meeting % 2, : partial.numel()].view(shape), partial)
    assert not peers.holds(torch.zeros(capacity + 1, 1, dtype=dtype))  # more than the buffer holds
    assert not peers.holds(torch.zeros(2 * summed_norm.MAX_PROGRAMS + 1, 2048, dtype=dtype))  # more blocks than flags
    assert not peers.holds(torch.zeros(1, 8, dtype=torch.float16 if dtype == torch.float32 else torch.float32))


def test_one_rank_meeting_by_flags_then_values_then_flags_sums_each_time(triton_kernels, monkeypatch):
    """The ways may change between launches (a benchmark's variants): the flags leave their rows in
    their halves, which meeting by values must never read as landed, so it keeps halves of its own
    (EMPTY after each launch)."""
    [peers], kept = _ranks(1, torch.bfloat16, 2048)
    buffer = kept[0][0]
    empty = _bits(torch.tensor([summed_norm.EMPTY], dtype=torch.bfloat16))
    weight = torch.randn(2048, dtype=torch.bfloat16)
    with torch.no_grad():
        for by_values in (False, True, False, True, True, False):
            monkeypatch.setattr(summed_norm, "MEET_BY_VALUES", by_values)
            h, partial = torch.randn(1, 2048, dtype=torch.bfloat16), torch.randn(1, 2048, dtype=torch.bfloat16)
            total, out = summed_norm.summed_add_rms_norm_triton(h, partial, weight, EPS, peers)
            want_total, want_out = add_rms_norm(h, partial, weight, EPS)
            assert torch.equal(total, want_total) and torch.equal(out, want_out)
            assert (_bits(buffer.view(4, 2048)[2:]) == empty).all()  # the values' halves: EMPTY
    assert not (_bits(buffer.view(4, 2048)[:2]) == empty).all()  # the flags' rows left behind


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as their bits (EMPTY, -0.0, compared exactly)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _ranks_on_streams(world: int, by_values: bool) -> None:
    """`world` ranks of one GPU, a stream each, launch the kernel at once, five times with rows
    drawn afresh (-0.0 among them) and 64, 3, 64, 1 and 40 rows; each rank must get
    add_rms_norm(h, the rank-order sum of the ranks' rows rounded once), bit for bit."""
    torch.set_grad_enabled(False)
    summed_norm.MEET_BY_VALUES = by_values
    device, dtype, width = torch.device("cuda"), torch.bfloat16, 2048
    peers, kept = _ranks(world, dtype, 64 * width, device)
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    for stream in streams:  # memory cached for each stream: no allocation (which may wait) while ranks meet
        with torch.cuda.stream(stream):
            for nbytes in (64 << 20, 1 << 20):  # the allocator's large and small pools
                torch.empty(nbytes, dtype=torch.uint8, device=device)
    weight = torch.randn(width, dtype=dtype, device=device)
    for n in (64, 3, 64, 1, 40):
        h = torch.randn(n, width, dtype=dtype, device=device)
        partials = [torch.randn(n, width, device=device).to(dtype) for _ in range(world)]
        partials[0][0, :7] = -0.0  # the EMPTY bits, as a rank's own value
        want = add_rms_norm(h, sum(p.float() for p in partials).to(dtype), weight, EPS)
        torch.cuda.synchronize(device)
        got = []
        for rank, stream in enumerate(streams):
            with torch.cuda.stream(stream):
                got.append(summed_norm.summed_add_rms_norm_triton(h, partials[rank], weight, EPS, peers[rank]))
        torch.cuda.synchronize(device)
        for total, out in got:
            assert torch.equal(total, want[0]) and torch.equal(out, want[1]), (world, by_values, n)
    del kept
    print("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: concurrent kernels that wait for each other")
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("by_values", [False, True])
def test_ranks_on_one_gpu_meet_and_sum_in_rank_order(world, by_values):
    root = str(Path(__file__).resolve().parents[1])  # moemesh, for the subprocess's import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, __file__, str(world), str(int(by_values))],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


class _Summed:
    """A stand-in all-reduce: counts its calls, returns 2 x."""

    def __init__(self, x):
        self.x, self.calls = x, 0

    def __call__(self):
        self.calls += 1
        return 2 * self.x


def test_a_left_sum_is_taken_by_the_norm_after_it():
    h, partial, weight = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    summed = _Summed(partial)
    with torch.no_grad(), summed_norm.sums_left_to_norms():
        assert summed_norm.leaving()
        assert summed_norm.leave(partial, summed, None) is partial
        total, out = summed_norm.add_summed_rms_norm(h, partial.view(3, 2, 4).view(3, 8), weight, EPS)
    want_total, want_out = add_rms_norm(h, 2 * partial, weight, EPS)
    assert summed.calls == 1 and torch.equal(total, want_total) and torch.equal(out, want_out)
    # Not left: the plain add and norm; an add with no norm after it takes the sum itself.
    assert torch.equal(summed_norm.add_summed_rms_norm(h, partial, weight, EPS)[0], h + partial)
    with torch.no_grad(), summed_norm.sums_left_to_norms():
        summed_norm.leave(partial, summed, None)
        assert torch.equal(summed_norm.settled(partial), 2 * partial)
        assert summed_norm.settled(h) is h


def test_a_left_sum_that_goes_astray_is_an_error():
    partial, other, weight = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    assert not summed_norm.leaving()  # outside the engine's layers
    with torch.enable_grad(), summed_norm.sums_left_to_norms():
        assert not summed_norm.leaving()  # gradients: never
    with pytest.raises(RuntimeError, match="no norm took it"), torch.no_grad(), summed_norm.sums_left_to_norms():
        summed_norm.leave(partial, _Summed(partial), None)
    with pytest.raises(RuntimeError, match="another tensor"), torch.no_grad(), summed_norm.sums_left_to_norms():
        summed_norm.leave(partial, _Summed(partial), None)
        summed_norm.add_summed_rms_norm(other, other, weight, EPS)
    with pytest.raises(RuntimeError, match="left before it"), torch.no_grad(), summed_norm.sums_left_to_norms():
        summed_norm.leave(partial, _Summed(partial), None)
        summed_norm.leave(other, _Summed(other), None)
    # An error inside leaves nothing behind for the next forward.
    with torch.no_grad(), summed_norm.sums_left_to_norms():
        assert summed_norm.leave(partial, _Summed(partial), None) is partial
        summed_norm.settled(partial)


if __name__ == "__main__":  # test_ranks_on_one_gpu_meet_and_sum_in_rank_order's subprocess
    _ranks_on_streams(int(sys.argv[1]), bool(int(sys.argv[2])))
