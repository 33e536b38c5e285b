"""ops/summed_norm.py: a tensor-parallel partial sum left to the residual add and norm after it.

The kernel is checked here on one rank (interpreted on CPU, compiled on a GPU): its buffer table,
its meetings at the signal pad and its sum of one rank's rows are all there, and one rank's sum is
the partial itself, so the result must be `add_rms_norm`'s kernel's bit for bit, in fp32 and bf16
(the same conversions in the same order); each launch must count one meeting a program and write
the rows into the half of the buffer of that count's parity. Several ranks need GPUs that map each other's memory:
`bench/decode.py --all-reduce` checks the kernel there against the all-reduce followed by
`add_rms_norm`, bit for bit. The hand-over itself runs on CPU under gloo in every tensor-parallel
generation test (tests/test_parallel_generate.py, test_parallel_serve.py), where each left sum is
the all-reduce as before.
"""

import pytest
import torch

from moemesh.ops import summed_norm
from moemesh.ops.rms_norm import add_rms_norm, rms_norm_blocks

EPS = 1e-6


def _one_rank(dtype: torch.dtype, capacity: int):
    """A PeerMemory of one rank over a buffer and flags of this process (kept alive by the
    returned tuple)."""
    device = torch.get_default_device()
    buffer = torch.zeros(summed_norm.PeerMemory.buffer_numel(1, capacity), dtype=dtype, device=device)
    flags = torch.zeros(summed_norm.PeerMemory.flags_numel(1), dtype=torch.int32, device=device)
    tables = torch.tensor([[buffer.data_ptr()], [flags.data_ptr()]], dtype=torch.int64, device=device)
    peers = summed_norm.PeerMemory(tables[0].data_ptr(), tables[1].data_ptr(), 0, 1, capacity, dtype)
    return peers, (buffer, flags, tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 2048), (5, 130), (300, 64), (600, 1024)])
def test_the_kernel_on_one_rank_is_the_add_and_norm(triton_kernels, shape, dtype):
    capacity = 300 * 2048
    peers, (buffer, flags, _) = _one_rank(dtype, capacity)
    h, partial = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    assert peers.holds(partial)
    programs = -(-shape[0] // rms_norm_blocks(shape[-1])[0])  # a block of rows each
    with torch.no_grad():
        want_total, want_out = add_rms_norm(h, partial, weight, EPS)
        for meeting in (1, 2, 3):  # one half of the buffer, then the other, then the first again
            total, out = summed_norm.summed_add_rms_norm_triton(h, partial, weight, EPS, peers)
            assert torch.equal(total, want_total) and torch.equal(out, want_out)
            # Each program's flag at this (the one) rank counts its meetings, as does its count.
            meetings = summed_norm.MAX_PROGRAMS
            assert (flags[:programs] == meeting).all() and (flags[meetings : meetings + programs] == meeting).all()
            assert not flags[programs:meetings].any() and not flags[meetings + programs :].any()
            half = buffer.view(2, capacity)[meeting % 2, : partial.numel()]
            assert torch.equal(half.view(shape), partial)  # this rank's rows, in that meeting's half
    assert not peers.holds(torch.zeros(capacity + 1, 1, dtype=dtype))  # more than the buffer holds
    assert not peers.holds(torch.zeros(2 * summed_norm.MAX_PROGRAMS + 1, 2048, dtype=dtype))  # more blocks than flags
    assert not peers.holds(torch.zeros(1, 8, dtype=torch.float16 if dtype == torch.float32 else torch.float32))


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
