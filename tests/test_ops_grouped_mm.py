"""grouped_mm over a buffer with rows past its last group, as expert parallelism's gathering
dispatcher sizes its buffer before the routing is known: the groups' rows, their input gradient
and the weight gradient are those of the groups alone; the rows past them, whatever they hold
(NaN here), reach nothing.

On the CPU the loop runs (fp32, against float64: 1e-6 relative); on a GPU the bf16 kernel
(`torch._grouped_mm`), against the fp32 loop: 1e-2 (bf16 operands, fp32 accumulation)."""

import pytest
import torch

from moemesh.ops.grouped_mm import grouped_mm
from numerics import rel_err


@pytest.mark.parametrize("sizes, rest", [([5, 0, 17, 3], 9), ([0, 0, 0, 0], 4), ([8, 8, 8, 8], 0)])
def test_rows_past_the_last_group_reach_nothing(sizes, rest):
    on_gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    tolerance = 1e-2 if on_gpu else 1e-6
    group_sizes = torch.tensor(sizes, device=device)
    rows = sum(sizes)
    x = torch.randn(rows + rest, 64, device=device, dtype=dtype)
    x[rows:] = float("nan")  # a buffer's unwritten rows
    weight = torch.randn(len(sizes), 48, 64, device=device, dtype=dtype, requires_grad=True)
    x.requires_grad_()
    out = grouped_mm(x, weight, group_sizes)
    grad = torch.randn(rows + rest, 48, device=device, dtype=dtype)
    grad[rows:] = float("nan")  # nothing reads those rows' outputs, so their gradient is garbage too
    grad_x, grad_weight = torch.autograd.grad(out, (x, weight), grad)

    reference_x = x.detach()[:rows].double().cpu().requires_grad_()
    reference_w = weight.detach().double().cpu().requires_grad_()
    pieces = torch.split(reference_x, sizes)
    reference = torch.cat([p @ w.T for p, w in zip(pieces, reference_w)])
    ref_grad_x, ref_grad_w = torch.autograd.grad(reference, (reference_x, reference_w), grad[:rows].double().cpu())
    assert out.shape == (rows + rest, 48) and grad_x.shape == x.shape
    if rows:
        assert rel_err(out[:rows].double().cpu(), reference) <= tolerance
        assert rel_err(grad_x[:rows].double().cpu(), ref_grad_x) <= tolerance
    assert torch.isfinite(grad_weight).all()
    assert rel_err(grad_weight.double().cpu(), ref_grad_w) <= tolerance if rows else grad_weight.abs().max() == 0
