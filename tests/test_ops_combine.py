"""combine: Triton kernel (forward, fan-out backward, routing-weight gradient) vs reference.

Tolerances: fp32 kernel vs fp32 reference differ only in summation order (k terms in the forward,
H terms in the weight gradient's dot product): relative (Frobenius) error <= 1e-6. The bf16 kernel
vs the fp32 reference: one bf16 rounding of the output, <= 1e-2.
"""

import pytest
import torch

from moemesh.ops import combine, permute
from moemesh.ops.combine import combine_reference
from numerics import rel_err


def layout(num_tokens, num_experts, k, align, hidden, dtype=torch.float32):
    """(grouped expert outputs, position, routing weights) with experts 0 and 5 left empty."""
    scores = torch.rand(num_tokens, num_experts)
    scores[:, [0, 5]] = -float("inf")
    topk_ids = scores.topk(k, dim=1).indices
    position = permute(torch.zeros(num_tokens, 1), topk_ids, num_experts, align).position
    num_rows = int(position.max()) + 1 + align if num_tokens else align  # some trailing padding too
    grouped = torch.randn(num_rows, hidden, dtype=dtype, requires_grad=True)
    weights = torch.rand(num_tokens, k, requires_grad=True)
    return grouped, position, weights


@pytest.mark.parametrize(
    "num_tokens, hidden, align",
    [(23, 1, 1), (23, 130, 16), (23, 1000, 1), (5, 1000, 16), (0, 130, 16), (0, 1, 1)],
)
def test_triton_matches_reference(triton_kernels, num_tokens, hidden, align):
    grouped, position, weights = layout(num_tokens, 8, 3, align, hidden)
    got = combine(grouped, position, weights)
    want = combine_reference(grouped, position, weights)
    assert got.shape == (num_tokens, hidden) and got.dtype == grouped.dtype
    assert rel_err(got, want) <= 1e-6

    grad_out = torch.randn_like(want)
    got_grouped, got_weights = torch.autograd.grad(got, (grouped, weights), grad_out)
    want_grouped, want_weights = torch.autograd.grad(want, (grouped, weights), grad_out)
    assert rel_err(got_grouped, want_grouped) <= 1e-6
    unused = torch.ones(grouped.shape[0], dtype=torch.bool)
    unused[position.reshape(-1)] = False
    assert unused.any() and torch.all(got_grouped[unused] == 0)  # padding rows get exact zeros
    assert rel_err(got_weights, want_weights) <= 1e-6
    if num_tokens:
        assert got_weights.abs().min() > 0  # the routing-weight gradient is really computed


@pytest.mark.parametrize("needs", ["grouped", "weights"])
def test_triton_partial_gradients(triton_kernels, needs):
    grouped, position, weights = layout(9, 8, 2, 1, 40)
    inputs = {"grouped": grouped, "weights": weights}
    other = inputs["weights" if needs == "grouped" else "grouped"].detach()
    args = (grouped, position, other) if needs == "grouped" else (other, position, weights)
    grad_out = torch.randn(9, 40)
    (got,) = torch.autograd.grad(combine(*args), inputs[needs], grad_out)
    (want,) = torch.autograd.grad(combine_reference(*args), inputs[needs], grad_out)
    assert rel_err(got, want) <= 1e-6


def test_triton_bf16_vs_fp32_reference(triton_kernels):
    grouped, position, weights = layout(31, 8, 4, 16, 130, dtype=torch.bfloat16)
    got = combine(grouped, position, weights)
    reference_grouped = grouped.detach().float().requires_grad_()
    want = combine_reference(reference_grouped, position, weights)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 1e-2
    grad_out = torch.randn(31, 130)
    got_grads = torch.autograd.grad(got, (grouped, weights), grad_out.bfloat16())
    want_grads = torch.autograd.grad(want, (reference_grouped, weights), grad_out)
    for g, w in zip(got_grads, want_grads):
        assert rel_err(g, w) <= 1e-2


def test_reference_gradcheck():
    grouped, position, weights = layout(5, 8, 3, 4, 3)
    grouped = grouped.detach().double().requires_grad_()
    weights = weights.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda g, w: combine_reference(g, position, w), (grouped, weights))


def test_roundtrip_with_permute(triton_kernels):
    """permute then combine with weights summing to 1 gives x back (identity experts)."""
    x = torch.randn(17, 33)
    topk_ids = torch.rand(17, 6).topk(2, dim=1).indices
    weights = torch.softmax(torch.randn(17, 2), dim=1)
    layout_ = permute(x, topk_ids, 6, align=8)
    assert rel_err(combine(layout_.grouped, layout_.position, weights), x) <= 1e-6


@pytest.mark.parametrize("hidden", [1, 130])
def test_skipped_slots(triton_kernels, hidden):
    """With skip, a position of -1 adds nothing and gets no gradient: the same as pointing it at an
    extra zero row, the float64 oracle here, for the kernel and the reference alike."""
    grouped, position, weights = layout(23, 8, 3, 1, hidden)
    skipped = torch.rand(position.shape) < 0.4
    with_skips = torch.where(skipped, -1, position)
    padded = torch.cat([grouped, grouped.new_zeros(1, hidden)]).double()  # row N: the zero row
    want = combine_reference(padded, torch.where(skipped, grouped.shape[0], position), weights.double())
    grad_out = torch.randn(23, hidden)
    want_grouped, want_weights = torch.autograd.grad(want, (grouped, weights), grad_out.double())
    for op in (combine, combine_reference):
        got = op(grouped, with_skips, weights, skip=True)
        got_grouped, got_weights = torch.autograd.grad(got, (grouped, weights), grad_out)
        assert rel_err(got, want) <= 1e-6
        assert rel_err(got_grouped, want_grouped) <= 1e-6 and rel_err(got_weights, want_weights) <= 1e-6
        assert torch.all(got_weights[skipped] == 0)
        unread = torch.ones(grouped.shape[0], dtype=torch.bool)
        unread[with_skips[~skipped]] = False
        assert unread.any() and torch.all(got_grouped[unread] == 0)  # rows no slot reads: exact zeros
