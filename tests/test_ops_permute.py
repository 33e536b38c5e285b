"""permute: layout semantics (checked by brute force), Triton kernel vs reference, gradcheck.

Tolerances: the forward copies rows, so kernel and reference must agree exactly. The backward sums
k fp32 rows in possibly another order than autograd does, so it may differ by a few ulps:
relative (Frobenius) error <= 1e-6.
"""

import pytest
import torch

from moemesh.ops import permute
from moemesh.ops.permute import permute_reference, permute_rows, permute_rows_reference
from numerics import rel_err


def routing(num_tokens, num_experts, k, unused_experts=()):
    """Random distinct top-k experts per token; `unused_experts` are never chosen (empty groups)."""
    scores = torch.rand(num_tokens, num_experts)
    scores[:, list(unused_experts)] = -float("inf")
    return scores.topk(k, dim=1).indices


@pytest.mark.parametrize(
    "num_tokens, num_experts, k, align", [(0, 4, 2, 16), (1, 3, 3, 1), (13, 8, 2, 1), (13, 8, 3, 4)]
)
def test_layout_matches_brute_force(num_tokens, num_experts, k, align):
    x = torch.randn(num_tokens, 5)
    topk_ids = routing(num_tokens, num_experts, k, unused_experts=[1, num_experts - 1][: num_experts - k])
    out = permute_reference(x, topk_ids, num_experts, align)

    rows = [[] for _ in range(num_experts)]  # (token, slot) entries per expert, in (token, slot) order
    for t in range(num_tokens):
        for j in range(k):
            rows[int(topk_ids[t, j])].append((t, j))
    sizes = [-(-len(r) // align) * align for r in rows]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)

    assert out.counts.tolist() == [len(r) for r in rows]
    assert out.offsets.dtype == torch.int64 and out.offsets.tolist() == offsets
    assert out.host_offsets == tuple(offsets) and out.group_sizes == tuple(sizes)
    expected = torch.zeros(offsets[-1], 5)
    expected_position = torch.zeros(num_tokens, k, dtype=torch.int64)
    for e, entries in enumerate(rows):
        for rank, (t, j) in enumerate(entries):
            expected[offsets[e] + rank] = x[t]
            expected_position[t, j] = offsets[e] + rank
    assert torch.equal(out.position, expected_position)
    assert torch.equal(out.grouped, expected)  # padding rows are zero


@pytest.mark.parametrize(
    "num_tokens, hidden, align, num_experts, k",
    [
        (29, 1, 1, 8, 3),
        (29, 130, 16, 8, 3),
        (29, 1000, 1, 8, 3),
        (7, 1000, 16, 8, 3),
        (40, 64, 16, 64, 8),  # most of the 64 experts get no token
        (0, 130, 16, 8, 3),
        (0, 130, 1, 8, 3),
    ],
)
def test_triton_matches_reference(triton_kernels, num_tokens, hidden, align, num_experts, k):
    topk_ids = routing(num_tokens, num_experts, k, unused_experts=[0, 5])
    x = torch.randn(num_tokens, hidden, requires_grad=True)

    got = permute(x, topk_ids, num_experts, align)
    want = permute_reference(x, topk_ids, num_experts, align)
    assert torch.equal(got.grouped, want.grouped)
    assert torch.equal(got.position, want.position) and got.host_offsets == want.host_offsets

    # Padding rows get gradient too; it must not leak into any token's gradient.
    grad_grouped = torch.randn_like(want.grouped)
    (got_grad,) = torch.autograd.grad(got.grouped, x, grad_grouped)
    (want_grad,) = torch.autograd.grad(want.grouped, x, grad_grouped)
    assert got_grad.shape == x.shape
    assert rel_err(got_grad, want_grad) <= 1e-6


def test_triton_keeps_dtype_bf16(triton_kernels):
    x = torch.randn(11, 70, dtype=torch.bfloat16, requires_grad=True)
    topk_ids = routing(11, 6, 2)
    got, want = permute(x, topk_ids, 6, 16), permute_reference(x, topk_ids, 6, 16)
    assert got.grouped.dtype == torch.bfloat16 and torch.equal(got.grouped, want.grouped)
    grad = torch.randn_like(want.grouped)
    (got_grad,) = torch.autograd.grad(got.grouped, x, grad)
    (want_grad,) = torch.autograd.grad(want.grouped.float(), x, grad.float())  # fp32 reference sum
    assert got_grad.dtype == torch.bfloat16 and rel_err(got_grad, want_grad) <= 1e-2  # one bf16 rounding


@pytest.mark.parametrize("num_tokens, hidden, k, num_rows", [(29, 130, 3, 40), (29, 130, 3, 87), (0, 8, 2, 5)])
def test_rows_of_a_buffer_skip_positions_of_minus_one(triton_kernels, num_tokens, hidden, k, num_rows):
    """`permute_rows` as expert parallelism's gathering dispatcher uses it: a buffer of num_rows
    rows (fewer or more than the pairs), pairs that go to none (-1), rows no pair fills. The kernel
    writes every named row as the reference does, and each token's gradient is the sum over its
    named rows only."""
    named = min(num_rows - 3, num_tokens * k * 2 // 3)  # pairs with a row; 3+ rows left unnamed
    pairs = torch.randperm(num_tokens * k)[:named]
    taken = torch.randperm(num_rows)[:named]  # distinct rows
    position = torch.full((num_tokens * k,), -1, dtype=torch.int64)
    position[pairs] = taken
    position = position.view(num_tokens, k)
    x = torch.randn(num_tokens, hidden, requires_grad=True)
    got, want = permute_rows(x, position, num_rows), permute_rows_reference(x, position, num_rows)
    assert torch.equal(got[taken], want[taken])  # the rest: unwritten by the kernel, zero in the reference
    grad = torch.randn(num_rows, hidden)
    grad_unnamed = grad.clone()
    grad_unnamed[taken] = 0  # rows no pair names must not reach any token
    (got_grad,) = torch.autograd.grad(got, x, grad)
    (want_grad,) = torch.autograd.grad(want, x, grad - grad_unnamed)
    assert rel_err(got_grad, want_grad) <= 1e-6 if num_tokens else got_grad.shape == x.shape


def test_reference_gradcheck():
    layout = permute_reference(torch.zeros(6, 1), routing(6, 4, 2), 4, align=4)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    num_rows = layout.host_offsets[-1]
    assert torch.autograd.gradcheck(lambda x: permute_rows_reference(x, layout.position, num_rows), (x,))


@pytest.mark.parametrize("bad_id", [4, -1])
def test_bad_expert_id_is_a_clear_error(bad_id):
    with pytest.raises(ValueError, match="num_experts"):
        permute(torch.zeros(2, 4), torch.tensor([[0], [bad_id]]), num_experts=4)
