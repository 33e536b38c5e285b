"""The training router's fused choice (`ops/topk_softmax.routed`): probabilities, top-k weights,
expert ids and per-expert choice counts, and the gradient back to the logits, against the PyTorch
form in float64.

fp32 kernel against fp64: a softmax and a renormalisation, relative error <= 1e-6 for values and
the logits' gradient. Ids and counts are exact (random logits: no ties). The gradient is checked
through the weights alone, the probabilities alone (the load-balancing loss sums them, so their
gradient reaches the kernel expanded from [E]) and both."""

import pytest
import torch

from moemesh.ops.topk_softmax import routed, routed_reference
from numerics import rel_err


@pytest.mark.parametrize("tokens, experts, k", [(1, 128, 8), (37, 60, 4), (5, 8, 8), (0, 16, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("through", ["weights", "probs", "both"])
def test_routed_matches_the_float64_reference(triton_kernels, tokens, experts, k, renormalize, through):
    logits = (torch.randn(tokens, experts) * 3).requires_grad_()
    got = routed(logits, k, renormalize)
    exact_logits = logits.detach().double().requires_grad_()
    want = routed_reference(exact_logits, k, renormalize)
    probs, weights, ids, counts = got
    assert probs.dtype == weights.dtype == counts.dtype == torch.float32 and ids.dtype == torch.long
    assert torch.equal(ids, want[2]) and torch.equal(counts, want[3].float())
    assert rel_err(probs, want[0]) <= 1e-6 and rel_err(weights, want[1]) <= 1e-6
    grad_weights, grad_prob_sum = torch.randn(tokens, k, dtype=torch.float64), torch.randn(experts, dtype=torch.float64)

    def loss(probs, weights):
        parts = []
        if through in ("weights", "both"):
            parts.append((weights * grad_weights.to(weights.dtype)).sum())
        if through in ("probs", "both"):
            parts.append((probs.sum(0) * grad_prob_sum.to(probs.dtype)).sum())
        return sum(parts)

    (got_grad,) = torch.autograd.grad(loss(probs, weights), logits)
    (want_grad,) = torch.autograd.grad(loss(want[0], want[1]), exact_logits)
    assert got_grad.dtype == logits.dtype and rel_err(got_grad, want_grad) <= 1e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16: Triton's CPU interpreter truncates to bf16")
def test_routed_takes_bf16_logits(triton_kernels):
    # distinct values a row (multiples of 1/16, exact in bf16): random bf16 logits tie, and a tie
    # may go to either expert
    logits = (torch.stack([torch.randperm(128) for _ in range(64)]) / 16 - 4).bfloat16().requires_grad_()
    probs, weights, _, _ = routed(logits, 8, True)
    exact = logits.detach().double().requires_grad_()
    want = routed_reference(exact, 8, True)
    assert rel_err(probs, want[0]) <= 1e-6 and rel_err(weights, want[1]) <= 1e-6  # fp32 from the same bf16 logits
    grad = torch.randn(64, 8, dtype=torch.float64)
    (got_grad,) = torch.autograd.grad((weights * grad.float()).sum(), logits)
    (want_grad,) = torch.autograd.grad((want[1] * grad).sum(), exact)
    assert got_grad.dtype == torch.bfloat16 and rel_err(got_grad, want_grad) <= 1e-2


def test_routed_refuses_a_k_beyond_the_experts():
    with pytest.raises(ValueError, match=r"0 < k <= E, got \(2, 4\) and k=5"):
        routed(torch.randn(2, 4), 5, True)
