"""linear_cross_entropy: reference vs F.cross_entropy, per-chunk Triton step vs its torch
reference, the chunked op vs the full-logits reference, gradcheck, edge cases.

Tolerances: the chunked op and the reference compute the same fp32 math; they differ in summation
order (logsumexp over V, the per-chunk weight-gradient sums, the final loss sum), which is a few
ulps per reduction: relative (Frobenius) error <= 1e-5 for losses and gradients, <= 1e-6 for the
single-chunk-step comparison. bf16 vs the fp32 reference: bf16 logits and gradients, <= 1e-2.
"""

import pytest
import torch
import torch.nn.functional as F

from moemesh.ops import linear_cross_entropy
from moemesh.ops.linear_cross_entropy import (
    chunked_linear_cross_entropy,
    cross_entropy_step_torch,
    cross_entropy_step_triton,
    linear_cross_entropy_reference,
)
from numerics import rel_err


def problem(num_tokens, hidden, vocab, ignored_every=4, dtype=torch.float32):
    h = torch.randn(num_tokens, hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden) / hidden**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (num_tokens,))
    labels[::ignored_every] = -100
    return h, w, labels


def test_reference_is_cross_entropy_plus_z_loss():
    h, w, labels = problem(19, 7, 50)
    logits = h @ w.T
    ce = F.cross_entropy(logits, labels, ignore_index=-100)
    assert torch.allclose(linear_cross_entropy_reference(h, w, labels), ce, rtol=1e-6)
    valid = labels != -100
    z = torch.logsumexp(logits[valid], dim=-1).pow(2).mean()
    assert torch.allclose(linear_cross_entropy_reference(h, w, labels, z_loss=0.1), ce + 0.1 * z, rtol=1e-6)
    assert torch.allclose(
        linear_cross_entropy_reference(h, w, labels, reduction="sum"),
        F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"),
        rtol=1e-6,
    )


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
@pytest.mark.parametrize("vocab", [1, 300, 5000])
def test_triton_step_matches_torch_step(triton_kernels, vocab, z_loss):
    logits = 4 * torch.randn(13, vocab)
    labels = torch.randint(0, vocab, (13,))
    labels[[2, 7]] = -100
    scale = torch.tensor([1 / 11])
    results = []
    for step in (cross_entropy_step_triton, cross_entropy_step_torch):
        grads, row_loss = logits.clone(), torch.full((13,), float("nan"))
        step(grads, labels, row_loss, scale, -100, z_loss)
        results.append((grads, row_loss))
    (got_grad, got_loss), (want_grad, want_loss) = results
    assert rel_err(got_loss, want_loss) <= 1e-6 and rel_err(got_grad, want_grad) <= 1e-6
    assert torch.all(got_grad[[2, 7]] == 0) and torch.all(got_loss[[2, 7]] == 0)


@pytest.mark.parametrize(
    "num_tokens, hidden, vocab, chunk_size, z_loss, reduction",
    [
        (37, 130, 300, 8, 0.0, "mean"),
        (37, 1, 300, None, 1e-3, "mean"),
        (10, 130, 1000, 3, 1e-3, "sum"),
        (0, 130, 300, 8, 0.0, "mean"),
    ],
)
def test_triton_matches_reference(triton_kernels, num_tokens, hidden, vocab, chunk_size, z_loss, reduction):
    h, w, labels = problem(num_tokens, hidden, vocab)
    got = linear_cross_entropy(h, w, labels, z_loss=z_loss, reduction=reduction, chunk_size=chunk_size)
    want = linear_cross_entropy_reference(h, w, labels, z_loss=z_loss, reduction=reduction)
    assert got.dtype == torch.float32 and rel_err(got, want) <= 1e-5
    # A non-unit incoming gradient checks that backward scales the stored gradients.
    got_grads = torch.autograd.grad(2.5 * got, (h, w), allow_unused=True)
    want_grads = torch.autograd.grad(2.5 * want, (h, w))
    for g, wg in zip(got_grads, want_grads):
        assert g is not None and rel_err(g, wg) <= 1e-5


def test_triton_only_weight_needs_grad(triton_kernels):
    h, w, labels = problem(12, 20, 64)
    h = h.detach()
    (got,) = torch.autograd.grad(linear_cross_entropy(h, w, labels, chunk_size=5), w)
    (want,) = torch.autograd.grad(linear_cross_entropy_reference(h, w, labels), w)
    assert rel_err(got, want) <= 1e-5


def test_triton_without_grad(triton_kernels):
    h, w, labels = problem(12, 20, 64)
    with torch.no_grad():
        got = linear_cross_entropy(h, w, labels, z_loss=1e-3, chunk_size=5)
    assert not got.requires_grad
    assert rel_err(got, linear_cross_entropy_reference(h, w, labels, z_loss=1e-3)) <= 1e-5


def test_triton_bf16_vs_fp32_reference(triton_kernels):
    h, w, labels = problem(24, 64, 500, dtype=torch.bfloat16)
    got = linear_cross_entropy(h, w, labels, z_loss=1e-3, chunk_size=10)
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    want = linear_cross_entropy_reference(h32, w32, labels, z_loss=1e-3)
    assert rel_err(got, want) <= 1e-2
    for g, wg in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h32, w32))):
        assert g.dtype == torch.bfloat16 and rel_err(g, wg) <= 1e-2


@pytest.mark.parametrize("mode", ["triton", "torch"])
def test_all_ignored_gives_zero_loss_and_gradients(request, monkeypatch, mode):
    if mode == "triton":
        request.getfixturevalue("triton_kernels")  # on the GPU where there is one
    else:
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    h, w, _ = problem(6, 8, 30)
    loss = linear_cross_entropy(h, w, torch.full((6,), -100), z_loss=1e-3, chunk_size=4)
    grads = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0 and all(torch.all(g == 0) for g in grads)


def test_chunked_algorithm_gradcheck():
    """The chunked algorithm with the torch step, in float64, against finite differences."""
    h, w, labels = problem(7, 3, 11, ignored_every=3, dtype=torch.float64)
    chunked = lambda h, w: chunked_linear_cross_entropy(  # noqa: E731
        h, w, labels, -100, 0.1, "mean", 3, cross_entropy_step_torch
    )
    assert torch.autograd.gradcheck(chunked, (h, w))


def test_reference_gradcheck():
    h, w, labels = problem(5, 3, 7, ignored_every=3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: linear_cross_entropy_reference(h, w, labels, z_loss=0.1), (h, w))


def test_leading_dims_are_flattened(triton_kernels):
    h, w, labels = problem(12, 16, 40)
    got = linear_cross_entropy(h.view(3, 4, 16), w, labels.view(3, 4), chunk_size=5)
    assert rel_err(got, linear_cross_entropy_reference(h, w, labels)) <= 1e-5
