"""ops/summed_norm.py: a tensor-parallel partial sum left to the residual add and norm after it.

The kernel is checked here on one rank (interpreted on CPU, compiled on a GPU): its buffer table,
its count of meetings and its sum of one rank's rows are all there, and one rank's sum is the
partial itself, so the result must be `add_rms_norm`'s kernel's bit for bit, in fp32 and bf16 (the
same conversions in the same order); each launch must count one meeting a program and leave every
slot EMPTY again. Several ranks run on one GPU as concurrent streams, each its own buffer and
counts in that GPU's memory: they give the rank-order sum of every rank's rows, launch after
launch, bit for bit (in a subprocess with a time limit: a meeting that never ends hangs its GPU).
On several GPUs `bench/serve/decode.py --all-reduce` checks the kernel against the all-reduce followed
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
    """PeerMemory of `world` ranks over buffers and counts of meetings of this process, one a rank
    (kept alive by the returned tuple)."""
    device = device or torch.get_default_device()
    buffers = [
        summed_norm.PeerMemory.emptied(
            torch.empty(summed_norm.PeerMemory.buffer_numel(world, capacity), dtype=dtype, device=device)
        )
        for _ in range(world)
    ]
    meetings = [torch.zeros(summed_norm.MAX_PROGRAMS, dtype=torch.int32, device=device) for _ in range(world)]
    table = torch.tensor([t.data_ptr() for t in buffers], device=device)
    peers = [
        summed_norm.PeerMemory(table.data_ptr(), meetings[rank].data_ptr(), rank, world, capacity, dtype)
        for rank in range(world)
    ]
    return peers, (buffers, meetings, table)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (5, 130), (300, 64), (600, 1024)])
def test_the_kernel_on_one_rank_is_the_add_and_norm(triton_kernels, shape, dtype):
    capacity = 300 * 2048
    [peers], ([buffer], [meetings], _) = _ranks(1, dtype, capacity)
    h, partial = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    partial[0, :3] = -0.0  # EMPTY's bits as a value: written as +0.0, the same sum
    weight = torch.randn(shape[-1], dtype=dtype)
    assert peers.holds(partial)
    programs = -(-shape[0] // rms_norm_blocks(shape[-1])[0])  # a block of rows each
    empty = _bits(torch.tensor([summed_norm.EMPTY], dtype=dtype))
    with torch.no_grad():
        want_total, want_out = add_rms_norm(h, partial, weight, EPS)
        for meeting in (1, 2, 3):  # (the count's parity picks the half written: one, the other, the first)
            total, out = summed_norm.summed_add_rms_norm_triton(h, partial, weight, EPS, peers)
            assert torch.equal(total, want_total) and torch.equal(out, want_out)
            assert (meetings[:programs] == meeting).all() and not meetings[programs:].any()  # a count a program
            assert (_bits(buffer) == empty).all()  # read, and EMPTY again: every slot
    assert not peers.holds(torch.zeros(capacity + 1, 1, dtype=dtype))  # more than the buffer holds
    assert not peers.holds(torch.zeros(2 * summed_norm.MAX_PROGRAMS + 1, 2048, dtype=dtype))  # more blocks than counts
    assert not peers.holds(torch.zeros(1, 8, dtype=torch.float16 if dtype == torch.float32 else torch.float32))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's elements as their bits (EMPTY, -0.0, compared exactly)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _ranks_on_streams(world: int) -> None:
    """`world` ranks of one GPU, a stream each, launch the kernel at once, five times with rows
    drawn afresh (-0.0 among them) and 64, 3, 64, 1 and 40 rows; each rank must get
    add_rms_norm(h, the rank-order sum of the ranks' rows rounded once), bit for bit."""
    torch.set_grad_enabled(False)
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
            assert torch.equal(total, want[0]) and torch.equal(out, want[1]), (world, n)
    del kept
    print("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: concurrent kernels that wait for each other")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_one_gpu_meet_and_sum_in_rank_order(world):
    root = str(Path(__file__).resolve().parents[1])  # moemesh, for the subprocess's import
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, __file__, str(world)],
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
    _ranks_on_streams(int(sys.argv[1]))
