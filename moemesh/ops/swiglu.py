"""SwiGLU on the packed gate/up layout: `[N, 2I] -> [N, I]`, out = silu(gate) * up.

The first I columns are the gate, the last I the up projection -- the split of HF's fused
`gate_up_proj [E, 2I, H]` output (`gate, up = y.chunk(2, dim=-1)`). Math runs in fp32 and rounds
once. The backward saves only the packed input (the output is recomputed, not stored) and writes
the gradient in the same packed layout, so it flows straight into the fused gate_up GEMM.
"""

import torch
import torch.nn.functional as F

from moemesh.ops.backend import block_size, tl, triton, use_triton


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension (gate | up), got {tuple(gate_up.shape)}")
    if use_triton(gate_up):
        return _SwiGLU.apply(gate_up)
    return swiglu_reference(gate_up)


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32)).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        return swiglu_triton(gate_up)

    @staticmethod
    def backward(ctx, grad_out):
        (gate_up,) = ctx.saved_tensors
        return swiglu_backward_triton(grad_out, gate_up)


def _launch(kernel, gate_up, *tensors):
    rows = gate_up.numel() // max(gate_up.shape[-1], 1)
    inner = gate_up.shape[-1] // 2
    if rows * inner > 0:  # a launch grid must not be empty
        block = block_size(inner)
        kernel[(rows, triton.cdiv(inner, block))](gate_up, *tensors, inner, BLOCK=block)


def swiglu_triton(gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    _launch(_swiglu_kernel, gate_up, out)
    return out


def swiglu_backward_triton(grad_out: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = gate_up.contiguous()
    grad_gate_up = torch.empty_like(gate_up)
    _launch(_swiglu_backward_kernel, gate_up, grad_out.contiguous(), grad_gate_up)
    return grad_gate_up


@triton.jit
def _swiglu_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * 2I can pass 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(gate_up_ptr, grad_out_ptr, grad_gate_up_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=mask, other=0.0).to(tl.float32)
    grad = tl.load(grad_out_ptr + row * inner + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    # d silu(g)/dg = s + g s (1 - s)
    grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
    grad_up = grad * gate * sig
    dtype = grad_gate_up_ptr.dtype.element_ty
    tl.store(grad_gate_up_ptr + row * 2 * inner + cols, grad_gate.to(dtype), mask=mask)
    tl.store(grad_gate_up_ptr + row * 2 * inner + inner + cols, grad_up.to(dtype), mask=mask)


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's SwiGLU on the same packed gate | up layout: the gate is clamped from above and the
    up projection on both sides (bounded activations for low-precision serving), the gate's
    sigmoid is sharpened by alpha, and the up projection carries a +1 (a residual path through
    the expert). fp32 math, rounded once; autograd differentiates it (PyTorch only, no kernel)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"clamped_swiglu needs an even last dimension (gate | up), got {tuple(gate_up.shape)}")
    gate, up = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32)).chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)
