"""swiglu: Triton kernel vs reference on the packed [N, 2I] layout, gradcheck of the reference.

Tolerances: both compute in fp32 with the same formula; they may differ by a few ulps (exp and
sigmoid implementations): relative (Frobenius) error <= 1e-6. bf16 kernel vs fp32 reference: one
bf16 rounding, <= 1e-2.
"""

import pytest
import torch
import torch.nn.functional as F

from moemesh.ops import swiglu
from moemesh.ops.swiglu import swiglu_reference
from numerics import rel_err


def test_reference_is_hf_chunk_split():
    gate_up = torch.randn(4, 10)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(swiglu_reference(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("shape", [(7, 2), (33, 260), (5, 2000), (0, 260), (2, 3, 260)])
def test_triton_matches_reference(triton_kernels, shape):
    gate_up = (3 * torch.randn(shape)).requires_grad_()  # wide range: exercise both silu tails
    got, want = swiglu(gate_up), swiglu_reference(gate_up)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert rel_err(got, want) <= 1e-6
    grad_out = torch.randn_like(want)
    (got_grad,) = torch.autograd.grad(got, gate_up, grad_out)
    (want_grad,) = torch.autograd.grad(want, gate_up, grad_out)
    assert rel_err(got_grad, want_grad) <= 1e-6


def test_triton_bf16_vs_fp32_reference(triton_kernels):
    gate_up = torch.randn(9, 260, dtype=torch.bfloat16, requires_grad=True)
    reference_input = gate_up.detach().float().requires_grad_()
    got, want = swiglu(gate_up), swiglu_reference(reference_input)
    assert got.dtype == torch.bfloat16 and rel_err(got, want) <= 1e-2
    grad_out = torch.randn(9, 130)
    (got_grad,) = torch.autograd.grad(got, gate_up, grad_out.bfloat16())
    (want_grad,) = torch.autograd.grad(want, reference_input, grad_out)
    assert got_grad.dtype == torch.bfloat16 and rel_err(got_grad, want_grad) <= 1e-2


def test_reference_gradcheck():
    gate_up = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu_reference, (gate_up,))


def test_odd_width_is_a_clear_error():
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 5))
