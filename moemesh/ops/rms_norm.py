"""RMSNorm over the last dimension, with transformers' numerics:

    h = x.float();  h = h * rsqrt(mean(h**2) + eps);  out = weight * h.to(x.dtype)

so the output's dtype is promote(weight.dtype, x.dtype), and the weight multiplies the rounded h.
Rows are all the leading dimensions. The forward kernel runs one program per block of rows (each
row whole in one tile, normalised in fp32) and writes the output and each row's fp32 rsqrt. For
the backward the autograd Function keeps only x as given (in its dtype), that rsqrt and the
weight -- never a normalised copy: h is recomputed. One backward kernel writes the gradient of x
and, per program, an fp32 partial sum over its rows of the weight gradient; torch sums the
partials (a fixed number for a given row count, whatever the device: deterministic).

`add_rms_norm` is a decoder layer's residual add and the norm after it in one launch (inference:
no autograd): the sum rounded to the inputs' dtype, as the add alone rounds it, then normalised —
the same bits as the two ops, one kernel fewer twice a layer of a decode step (where a kernel is a
few microseconds of launch and latency around a few kilobytes of work).
"""

import torch

from moemesh.ops.backend import block_size, dependent_launch, tl, triton, use_triton, wait_for_inputs

TILE = 4096  # elements per program and step: rows of one block x the row width (a power of two)
PARTIAL_SUMS = 512  # at most this many backward programs, each one partial weight-gradient row


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of `x [..., w]` scaled by `weight [w]`."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(
            f"rms_norm: weight {tuple(weight.shape)} does not match the last dimension of {tuple(x.shape)}"
        )
    if use_triton(x):
        return _RMSNorm.apply(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, rms_norm(h + delta, weight, eps)); with delta None, (h, rms_norm(h, ...)). One
    kernel where Triton runs and nothing needs a gradient; else the two ops."""
    if delta is None:
        return h, rms_norm(h, weight, eps)
    if not fuses_add(h, delta, weight):
        total = h + delta
        return total, rms_norm(total, weight, eps)
    rows = h.contiguous().view(-1, h.shape[-1])
    total = torch.empty_like(rows)
    out, _ = rms_norm_triton(rows, weight, eps, delta=delta.contiguous().view_as(rows), total=total)
    return total.view(h.shape), out.view(h.shape)


def fuses_add(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the add and the norm can be one kernel: Triton runs, delta is like h, and nothing
    needs a gradient."""
    return (
        use_triton(h)
        and delta.shape == h.shape
        and delta.dtype == h.dtype
        and weight.shape == h.shape[-1:]
        and not (torch.is_grad_enabled() and (h.requires_grad or delta.requires_grad or weight.requires_grad))
    )


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32, cast back before the scale, as transformers does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.contiguous().view(-1, x.shape[-1])  # a view of x itself when x is contiguous
        out, rstd = rms_norm_triton(rows, weight, eps)
        ctx.save_for_backward(rows, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad_out):
        rows, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward_triton(
            grad_out.reshape(rows.shape), rows, weight, rstd, weight_grad=ctx.needs_input_grad[1]
        )
        return grad_x.view(grad_out.shape), grad_weight, None


def rms_norm_blocks(width: int) -> tuple[int, int, int]:
    """(rows per block, tile width, warps): whole rows in a tile of about TILE elements."""
    block_w = block_size(width, largest=1 << 20)
    block_rows = max(1, TILE // block_w)
    return block_rows, block_w, min(16, max(4, block_rows * block_w // 512))


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    total: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [n, w]` contiguous -> (output [n, w], fp32 rsqrt per row [n]); with `delta` (like x), of
    x + delta instead, that sum written into `total` (like x, required with delta)."""
    if (delta is None) != (total is None):
        raise ValueError("rms_norm_triton: delta and total go together (the sum is written into total)")
    n, width = x.shape
    out = x.new_empty(n, width, dtype=torch.promote_types(weight.dtype, x.dtype))
    rstd = x.new_empty(n, dtype=torch.float32)
    if n:
        block_rows, block_w, warps = rms_norm_blocks(width)
        _rms_norm_kernel[(triton.cdiv(n, block_rows),)](
            x, x if delta is None else delta, x if total is None else total, weight.contiguous(), out, rstd, n, width,
            eps, HAS_DELTA=delta is not None, BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=warps,
            **dependent_launch(x),
        )  # fmt: skip
    return out, rstd


def rms_norm_backward_triton(grad_out, x, weight, rstd, weight_grad: bool = True):
    """Gradients of x (in x's dtype) and of weight (in its dtype; None without `weight_grad`: a
    frozen norm, as under LoRA, skips the partial sums' reduction) for `grad_out [n, w]`."""
    n, width = x.shape
    grad_x = torch.empty_like(x)
    if n == 0:
        return grad_x, torch.zeros_like(weight) if weight_grad else None
    block_rows, block_w, warps = rms_norm_blocks(width)
    rows_per_program = triton.cdiv(triton.cdiv(n, block_rows), PARTIAL_SUMS) * block_rows
    programs = triton.cdiv(n, rows_per_program)
    partials = x.new_empty(programs, width, dtype=torch.float32)
    _rms_norm_backward_kernel[(programs,)](
        grad_out.contiguous(), x, weight.contiguous(), rstd, grad_x, partials, n, width, rows_per_program,
        BLOCK_ROWS=block_rows, BLOCK_W=block_w, num_warps=warps,
    )  # fmt: skip
    return grad_x, partials.sum(0).to(weight.dtype) if weight_grad else None


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, total_ptr, weight_ptr, out_ptr, rstd_ptr, n, width, eps,
                     HAS_DELTA: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                     GDC: tl.constexpr):  # fmt: skip
    wait_for_inputs(GDC)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # 64-bit: rows * width
    cols = tl.arange(0, BLOCK_W)
    row_mask = rows < n
    mask = row_mask[:, None] & (cols < width)[None, :]
    offsets = rows[:, None] * width + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if HAS_DELTA:  # the residual add, rounded to x's dtype as the add alone would be
        x = (x.to(tl.float32) + tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + offsets, x, mask=mask)
    rstd = normalised_rows(x, cols, mask, offsets, width, eps, weight_ptr, out_ptr)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


@triton.jit
def normalised_rows(x, cols, mask, offsets, width, eps, weight_ptr, out_ptr):
    """weight * RMSNorm of the rows of x (a block of whole rows, in the input's dtype) stored at
    out_ptr + offsets; -> each row's fp32 rsqrt."""
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / width + eps)
    h = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32)  # rounded to x's dtype first
    weight = tl.load(weight_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
    tl.store(out_ptr + offsets, (weight[None, :] * h).to(out_ptr.dtype.element_ty), mask=mask)
    return rstd


@triton.jit
def _rms_norm_backward_kernel(grad_out_ptr, x_ptr, weight_ptr, rstd_ptr, grad_x_ptr, partials_ptr, n, width,
                              rows_per_program, BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
    # out = weight * h, h = x * rstd, rstd = (mean(x**2) + eps)**-0.5, so with g = grad_out * weight:
    #   grad_x = rstd * (g - x * rstd**2 * mean(g * x)),  grad_weight = sum over rows of grad_out * h.
    program = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    col_mask = cols < width
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    grad_weight = tl.zeros([BLOCK_W], dtype=tl.float32)
    for start in range(0, rows_per_program, BLOCK_ROWS):
        rows = program * rows_per_program + start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < n
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * width + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        h = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)  # as the forward rounded it
        grad_weight += tl.sum(grad * h, axis=0)
        g = grad * weight[None, :]
        mean_gx = tl.sum(g * x, axis=1) / width
        grad_x = rstd[:, None] * (g - x * (rstd * rstd * mean_gx)[:, None])
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(partials_ptr + program * width + cols, grad_weight, mask=col_mask)
