"""Deferred weight gradients (`moemesh/ops/weight_grad.py`): inside a deferred backward the
linear and grouped matmuls give the input gradient at once and the weight gradient only when the
store pops that backward's entry — then equal to the ordinary backward's (fp32: 1e-6 relative, the
same products; bf16 autocast: the same bf16 GEMMs, so equal too). With LoRA's factors on a frozen
base the deferred gradients are the factors', sent through their casts to the fp32 parameters."""

import pytest
import torch

from moemesh.ops.backend import autocast_inputs
from moemesh.ops.grouped_mm import grouped_mm
from moemesh.ops.linear import linear, linears
from moemesh.ops.low_rank import low_rank_factors, stacked_low_rank_factors
from moemesh.ops.weight_grad import WeightGradStore
from numerics import rel_err


def linear_case():
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(8, 16))
    bias = torch.nn.Parameter(torch.randn(8))
    return x, [weight], lambda: linear(x, weight, bias), [bias]


def grouped_case():
    sizes = torch.tensor([4, 0, 7, 1])  # an empty group too
    x = torch.randn(int(sizes.sum()), 16, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(4, 8, 16))
    return x, [weight], lambda: grouped_mm(x, weight, sizes), []


def lora_linear_case():
    x = torch.randn(3, 5, 16, requires_grad=True)
    weight, a, b = torch.randn(8, 16), torch.nn.Parameter(torch.randn(4, 16)), torch.nn.Parameter(torch.randn(8, 4))

    def run():
        (rows,) = autocast_inputs(x)
        return linear(rows, weight, None, low_rank_factors(a, b, rows.dtype, 2.5))

    return x, [a, b], run, []


def lora_linears_case():
    """Projections of one input (attention's q, k, v): stacked A, one node."""
    x = torch.randn(3, 5, 16, requires_grad=True)
    weights = [torch.randn(out, 16) for out in (8, 4, 4)]
    factors = [
        (torch.nn.Parameter(torch.randn(r, 16)), torch.nn.Parameter(torch.randn(out, r)))
        for out, r in ((8, 4), (4, 2), (4, 4))
    ]

    def run():
        (rows,) = autocast_inputs(x)
        a, bs = stacked_low_rank_factors([a for a, _ in factors], [b for _, b in factors], rows.dtype, [2.5, 1.0, 0.5])
        return torch.cat([out.flatten() for out in linears(rows, weights, a, bs)])

    return x, [t for pair in factors for t in pair], run, []


def lora_grouped_case():
    sizes = torch.tensor([4, 0, 7, 1])
    x = torch.randn(int(sizes.sum()), 16, requires_grad=True)
    weight = torch.randn(4, 8, 16)
    a, b = torch.nn.Parameter(torch.randn(4, 4, 16)), torch.nn.Parameter(torch.randn(4, 8, 4))

    def run():
        (rows,) = autocast_inputs(x)
        return grouped_mm(rows, weight, sizes, low_rank=low_rank_factors(a, b, rows.dtype, 2.5))

    return x, [a, b], run, []


@pytest.mark.parametrize("case", [linear_case, grouped_case, lora_linear_case, lora_linears_case, lora_grouped_case])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_deferred_weight_gradient_arrives_on_pop(case, autocast):
    x, deferred, run, others = case()
    grad_out = None

    def backward(store=None):
        nonlocal grad_out
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = run()
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
        if store is None:
            out.backward(grad_out)
        else:
            with store.deferring(True):
                out.backward(grad_out)

    backward()
    expected = {"x": x.grad.clone(), **{i: p.grad.clone() for i, p in enumerate(others)}}
    expected_deferred = [w.grad.clone() for w in deferred]
    for t in (x, *deferred, *others):
        t.grad = None

    store = WeightGradStore()
    backward(store)
    assert rel_err(x.grad, expected["x"]) <= 1e-6  # the input gradient at once
    assert all(rel_err(p.grad, expected[i]) <= 1e-6 for i, p in enumerate(others))  # biases too
    assert all(w.grad is None for w in deferred) and len(store) == 1
    store.pop()
    assert len(store) == 0
    for w, want in zip(deferred, expected_deferred):
        assert w.grad.dtype == torch.float32 and rel_err(w.grad, want) <= 1e-6


def test_entries_run_oldest_first_and_exist_without_jobs():
    x, (weight,), run, _ = linear_case()
    store = WeightGradStore()
    with store.deferring(True):
        run().sum().backward()
    with store.deferring(True):
        pass  # a deferred backward with no deferrable matmul still makes an entry: W counts match
    with store.deferring(True):
        (2 * run()).sum().backward()
    assert len(store) == 3 and weight.grad is None
    store.pop()
    first = weight.grad.clone()
    store.pop()
    assert torch.equal(weight.grad, first)  # the empty entry added nothing
    store.flush()
    assert rel_err(weight.grad, 3 * first) <= 1e-6
