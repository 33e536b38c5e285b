"""rms_norm: Triton kernel vs reference (transformers' RMSNorm), and what the kernel path saves.

Tolerances (relative Frobenius error, numerics.rel_err). fp32: the same formula in both; the sum of
squares is reduced in another order and rsqrt may differ by an ulp, so output, input gradient and
weight gradient agree to <= 1e-6 (measured ~1e-7). bf16 x: both round h = x * rsqrt to bf16
before the weight multiplies it, and a bf16 output once more. Compiled on a GPU, Triton rounds to
nearest even as torch does, and outputs differ only where a last-ulp difference of the rsqrt flips
a rounding; Triton's CPU interpreter truncates fp32 -> bf16 instead, up to one bf16 ulp (2**-8 to
2**-7 relative) per rounding: measured ~4e-3 with an fp32 weight, ~7e-3 with a bf16 weight (two
roundings). The gradients: the reference rounds grad_out * weight to bf16 before its fp32 backward
and forms the weight gradient from bf16 products, the kernel stays in fp32 and rounds once:
measured ~4e-3 and ~5e-3. Every bf16 check: <= 1e-2.
"""

import importlib

import pytest
import torch

from moemesh.models.layers import RMSNorm
from moemesh.ops import rms_norm
from moemesh.ops.rms_norm import rms_norm_reference
from numerics import rel_err

EPS = 1e-6


def _compare(x, weight, tolerance):
    x, weight = x.requires_grad_(), weight.requires_grad_()
    got, want = rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS)
    assert got.shape == x.shape and got.dtype == want.dtype == torch.promote_types(x.dtype, weight.dtype)
    assert rel_err(got, want) <= tolerance
    grad_out = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (x, weight), grad_out)
    want_grads = torch.autograd.grad(want, (x, weight), grad_out)
    for got_grad, want_grad in zip(got_grads, want_grads):
        assert got_grad.dtype == want_grad.dtype
        if x.shape[-1] == 1 and got_grad.shape == x.shape:
            # One column: x * rstd is +-1 up to eps, its gradient is all cancellation (rounding
            # noise in both), so measure against the size of the terms that cancel.
            scale = (grad_out * weight).float() * torch.rsqrt(x.float().pow(2) + EPS)
            assert rel_err(got_grad, want_grad) * want_grad.norm() <= tolerance * scale.norm()
        else:
            assert rel_err(got_grad, want_grad) <= tolerance


def test_reference_is_the_module():
    norm = RMSNorm(10, EPS)
    norm.weight.data.normal_()
    x = torch.randn(3, 10, dtype=torch.bfloat16)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    assert torch.equal(norm(x), norm.weight * h.to(x.dtype))  # transformers' formula, off the kernel path


@pytest.mark.parametrize("shape", [(7, 1), (33, 130), (5, 1000), (0, 130), (2, 3, 130), (2, 3, 4, 128)])
def test_triton_matches_reference_fp32(triton_kernels, shape):
    _compare(3 * torch.randn(shape), torch.randn(shape[-1]), 1e-6)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 130), (2, 5, 4, 128)])
def test_triton_matches_reference_bf16(triton_kernels, shape, weight_dtype):
    _compare(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape[-1], dtype=weight_dtype), 1e-2)


def test_non_contiguous_input(triton_kernels):
    x = torch.randn(2, 130, 6).transpose(1, 2)  # [2, 6, 130], rows not contiguous
    _compare(x, torch.randn(130), 1e-6)


def test_many_row_blocks_per_program(triton_kernels, monkeypatch):
    """The backward's programs each loop over several row blocks (partial weight-gradient sums)."""
    monkeypatch.setattr(importlib.import_module("moemesh.ops.rms_norm"), "PARTIAL_SUMS", 3)
    _compare(torch.randn(301, 130), torch.randn(130), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saves_only_input_and_rsqrt(triton_kernels, dtype):
    x = torch.randn(4, 6, 128, dtype=dtype, requires_grad=True)
    weight = torch.randn(128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = rms_norm(x, weight, EPS)
    activations = [t for t in saved if t.data_ptr() != weight.data_ptr()]
    assert len(saved) == 3 and len(activations) == 2
    x_saved, rstd = activations
    assert x_saved.dtype == dtype and x_saved.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert rstd.dtype == torch.float32 and rstd.shape == (24,)
    want = torch.rsqrt(x.detach().float().pow(2).mean(-1) + EPS).flatten()
    assert rel_err(rstd, want) <= 1e-6
    out.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape


def test_frozen_weight_takes_no_gradient(triton_kernels):
    """A frozen norm (LoRA's base) gets the same input gradient, and no weight gradient is reduced."""
    x, weight = torch.randn(5, 3, 130, requires_grad=True), torch.randn(130)
    grad_out = torch.randn(5, 3, 130)
    (frozen,) = torch.autograd.grad(rms_norm(x, weight, EPS), x, grad_out)
    (trained, _) = torch.autograd.grad(rms_norm(x, weight.requires_grad_(), EPS), (x, weight), grad_out)
    assert torch.equal(frozen, trained)


def test_weight_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="last dimension"):
        rms_norm(torch.zeros(2, 5), torch.ones(4), EPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 130), (9, 130), (2, 5, 128), (0, 130)])
def test_add_rms_norm_is_the_add_then_the_norm(triton_kernels, shape, dtype):
    """The fused residual add and norm (inference) against the two ops: the sum exactly (one
    rounding of the fp32 sum either way) and the norm as the kernel's own (`rms_norm`) — bit for
    bit where compiled (a GPU: both round to nearest even); Triton's CPU interpreter truncates
    fp32 -> bf16 where torch's add rounds, so there the bf16 sum may differ by an ulp (2**-7
    relative) and the norm with it."""
    from moemesh.ops.rms_norm import add_rms_norm

    h, delta = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    weight = torch.randn(shape[-1], dtype=dtype)
    with torch.no_grad():
        total, out = add_rms_norm(h, delta, weight, EPS)
        want_total = h + delta
        want_out = rms_norm(want_total, weight, EPS)
    assert total.shape == out.shape == h.shape and total.dtype == out.dtype == dtype
    if dtype == torch.float32 or torch.cuda.is_available():
        assert torch.equal(total, want_total)
        assert torch.equal(out, want_out)
    else:
        assert ((total.float() - want_total.float()).abs() <= 2**-7 * want_total.float().abs()).all()
        assert rel_err(out, want_out) <= 1e-2


def test_add_rms_norm_without_a_delta_or_with_gradients(triton_kernels):
    """No delta: h itself and its norm. Gradients wanted: the two ops (autograd runs through them)."""
    from moemesh.ops.rms_norm import add_rms_norm

    h, delta, weight = torch.randn(3, 130), torch.randn(3, 130), torch.randn(130, requires_grad=True)
    same, out = add_rms_norm(h, None, weight, EPS)
    assert same is h and torch.equal(out, rms_norm(h, weight, EPS))
    total, out = add_rms_norm(h, delta, weight, EPS)
    assert out.grad_fn is not None and torch.equal(total, h + delta)
    assert torch.autograd.grad(out.sum(), weight)[0].shape == weight.shape
