"""Rotary position embedding for training and prefill: `out = x·cos + rotate_half(x)·sin`, with
rotate_half(x) = (-x₂, x₁) over the two halves of the head dimension (transformers' layout).

Written out in PyTorch this is six kernels forward (two slices, a negation, a concatenation, two
products and a sum) and about as many backward, for q and again for k, in every layer, and a
third time when activation checkpointing recomputes the forward. Here it is one kernel each way.
The kernel reads x through its strides, so the [B, T, heads, D] projection seen as [B, heads, T,
D] is not copied first, and writes the output in x's layout, as PyTorch's elementwise ops do:
attention's output follows its query's layout, and in [B, T, heads, D] order o_proj reads it
without a copy (a contiguous [B, heads, T, D] query would cost that copy and its saved bytes).
It computes in fp32 and rounds once (the PyTorch form rounds after every operation in
bf16); the output's dtype is promote(x, cos). The backward is the transposed rotation,
gx₁ = g₁·cos₁ + g₂·sin₂ and gx₂ = g₂·cos₂ - g₁·sin₁, from the same tables; cos and sin get no
gradient (they are functions of the positions: the reference runs when they require one).

Limits: cos and sin are [T, D] (every row the same positions) or [B, T, D]; D is even.
"""

import torch

from moemesh.ops.backend import block_size, tl, triton, use_triton

ROWS = 16  # (batch, head, position) rows a program rotates


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated by cos, sin [T, D] or [B, T, D]."""
    if cos.dim() not in (2, 3) or cos.shape[-2:] != (x.shape[2], x.shape[3]) or cos.shape != sin.shape:
        raise ValueError(
            f"rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must be [T, D] or [B, T, D] for x "
            f"{tuple(x.shape)} [B, heads, T, D]"
        )
    if use_triton(x) and x.shape[-1] % 2 == 0 and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(x, cos, sin)
    return rotary_reference(x, cos, sin)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return _launch(grad_out, cos, sin, backward=True).to(ctx.x_dtype), None, None


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    batch, heads, seq, dim = x.shape
    out = torch.empty_like(x, dtype=torch.promote_types(x.dtype, cos.dtype))  # x's layout when x is dense
    cos, sin = cos.contiguous(), sin.contiguous()
    rows = batch * heads * seq
    if rows:
        _rotary_kernel[(triton.cdiv(rows, ROWS),)](
            x,
            cos,
            sin,
            out,
            rows,
            heads,
            seq,
            *x.stride(),
            *out.stride(),
            cos.stride(0) if cos.dim() == 3 else 0,
            HALF=dim // 2,
            BLOCK=block_size(dim // 2, smallest=1),
            ROWS=ROWS,
            BACKWARD=backward,
        )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    rows,
    heads,
    seq,
    stride_b,
    stride_h,
    stride_t,
    stride_d,
    out_stride_b,
    out_stride_h,
    out_stride_t,
    out_stride_d,
    table_stride_b,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # over (b, h, t), t fastest
    t = row % seq
    b = row // (seq * heads)
    h = (row // seq) % heads
    col = tl.arange(0, BLOCK)
    mask = (row < rows)[:, None] & (col < HALF)[None, :]
    x_at = x_ptr + (b * stride_b + h * stride_h + t * stride_t)[:, None] + col[None, :] * stride_d
    x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    table = (b * table_stride_b + t * 2 * HALF)[:, None] + col[None, :]
    cos1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:  # the transposed rotation
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    out_at = out_ptr + (b * out_stride_b + h * out_stride_h + t * out_stride_t)[:, None] + col[None, :] * out_stride_d
    tl.store(out_at, y1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_at + HALF * out_stride_d, y2.to(out_ptr.dtype.element_ty), mask=mask)
