"""rotary: the Triton kernel (one launch each way) against the PyTorch form, in float64.

Tolerances: the kernel computes in fp32 and rounds once; against the fp64 reference its fp32
output and gradient are within a few ulps (relative error <= 1e-6). In bf16 it rounds once where
the PyTorch form rounds after every product: both within bf16's precision of fp64 (<= 1e-2), and
compiled the kernel no worse than the PyTorch form. The input is a transposed view, as attention gives it.
"""

import pytest
import torch

from moemesh.models.rope import RotaryEmbedding
from moemesh.ops.rotary import rotary, rotary_reference
from numerics import rel_err


def _case(batch, heads, seq, dim, per_row, dtype=torch.float32):
    x = torch.randn(batch, seq, heads, dim, dtype=dtype).transpose(1, 2).requires_grad_()  # a view
    positions = torch.randint(0, 4096, (batch, seq) if per_row else (seq,))
    cos, sin = RotaryEmbedding(dim, 1e6)(positions, dtype)
    return x, cos, sin


@pytest.mark.parametrize("shape", [(2, 4, 7, 16), (1, 3, 33, 128), (3, 1, 5, 64), (1, 2, 0, 16)])
@pytest.mark.parametrize("per_row", [False, True])
def test_triton_matches_the_float64_reference(triton_kernels, shape, per_row):
    x, cos, sin = _case(*shape, per_row)
    got = rotary(x, cos, sin)
    want = rotary_reference(x.double(), cos.double(), sin.double())
    assert got.shape == x.shape and got.stride() == x.stride() and rel_err(got, want) <= 1e-6  # x's layout
    grad_out = torch.randn_like(want)
    (got_grad,) = torch.autograd.grad(got, x, grad_out.float())
    (want_grad,) = torch.autograd.grad(want, x, grad_out)
    assert got_grad.dtype == x.dtype and rel_err(got_grad, want_grad) <= 1e-6


def test_bf16_rounds_once(triton_kernels):
    x, cos, sin = _case(2, 4, 64, 128, per_row=False, dtype=torch.bfloat16)
    exact = rotary_reference(x.double(), cos.double(), sin.double())
    got, stepwise = rotary(x, cos, sin), rotary_reference(x, cos, sin)
    assert got.dtype == torch.bfloat16 and rel_err(got, exact) <= 1e-2
    if got.is_cuda:  # compiled, the one rounding is to nearest (Triton's CPU interpreter truncates)
        assert rel_err(got, exact) <= rel_err(stepwise, exact)
    grad_out = torch.randn_like(exact)
    (got_grad,) = torch.autograd.grad(got, x, grad_out.bfloat16())
    (want_grad,) = torch.autograd.grad(exact, x, grad_out)
    assert got_grad.dtype == torch.bfloat16 and rel_err(got_grad, want_grad) <= 1e-2


def test_tables_that_need_a_gradient_take_the_reference(triton_kernels):
    x, cos, sin = _case(1, 2, 5, 16, per_row=False)
    cos.requires_grad_()
    grad_out = torch.randn(x.shape)
    (grad_cos,) = torch.autograd.grad(rotary(x, cos, sin), cos, grad_out)
    (want,) = torch.autograd.grad(rotary_reference(x, cos, sin), cos, grad_out)
    assert torch.equal(grad_cos, want)


def test_tables_of_the_wrong_shape_are_a_clear_error():
    x = torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match=r"rotary: cos \(5, 8\) and sin \(5, 8\) must be \[T, D\]"):
        rotary(x, torch.ones(5, 8), torch.ones(5, 8))
