"""Linear layers for a few rows (decoding): up to three weights in one launch, each read once.

    gemv(x, [w_0, w_1, ...]) = [x @ w_0ᵀ, x @ w_1ᵀ, ...]        x [M, K], w_i [N_i, K], M <= 64

A decode step multiplies one row per sequence by every projection. cuBLAS measured at a quarter of
the memory bandwidth on the attention projections of one row (docs/benchmarks.md), and three
launches for q, k and v; here one program per block of output features of any of the weights
streams that block of its weight once, for all M rows at a time (the rows padded to the next
power of two, at least 16, for `tl.dot`; one row as a plain reduction, `ONE_ROW_REDUCTION`),
accumulating in fp32. Several weights share one launch
without being concatenated in memory: a program finds its weight from its index.

Up to 64 rows, not 16: at 17-64 rows cuBLAS ran q, k, v and the router as four GEMMs, three of
them ~5 µs kernels that do not shrink under tensor parallelism; this kernel made a decode step of
32 or 64 rows 1.01-1.04x faster on one H200 and 1.07-1.10x under TP=4 (docs/benchmarks.md, issue
49). Larger tiles of rows were not measured.

Under a dependent launch (ops/backend.py) each program reads its first block of weights before
it waits for the kernel before it: no kernel writes the weights, so that read overlaps the
previous kernel's tail (PREFETCH_WEIGHTS = False reads it after, for measuring the difference: on
two H200s a decode step of the 48-layer shape at TP=2 took 5% less time at batch 1 and 2% at 64
with it, one GPU's the same within the noise; docs/benchmarks.md, 2026-11-28).

Quantized weights (`ops/quantized_weight.py`: block FP8 codes with per-row tile scales, MXFP4
nibbles with E8M0 scales) are read as they are: one row's products come from `row_products` (the
codes decoded in registers, exact fp32 products summed by run in a register tile, on tiles of their own:
ROW_CONFIGS), more rows' from `load_rows` (the block decoded to the values `weight.to(x.dtype)`
gives, then multiplied as a dense block is); the reference is that dequantization, then `x @ w.T`.
The weights of one launch are all dense or all of one format.

Limits: forward only (the training path keeps `ops/linear.py`'s autograd), M <= MAX_ROWS, weights
of x's dtype, three at most, no bias (the caller adds it).
"""

import torch

from moemesh.ops.backend import dependent_launch, tl, triton, tuned, use_triton, wait_for_inputs
from moemesh.ops.quantized_weight import (
    QuantizedWeight,
    kernel_operands,
    load_rows,
    row_configs,
    row_products,
    tiles_by_format,
)

MAX_ROWS = 64
PREFETCH_WEIGHTS = True
# One row (batch 1) as a reduction rather than `tl.dot` (which pads the row to 16 and needs blocks
# of at least 16 outputs): blocks of 4 or 8 outputs then make 2-4x the programs, for the small
# weights of a tensor-parallel slice (q, k and v of 1,280 outputs at TP=4 were 80 programs for
# 132 SMs). The 48-layer shape's batch-1 decode step on H200s: 1.10x faster on one GPU, 1.12x at
# TP=2, 1.05x at TP=4 (docs/benchmarks.md, 2026-11-28). False: one row as before, for measuring.
ONE_ROW_REDUCTION = True
# Tiles tried at a shape's first launch (backend.tuned): wider ones keep more bytes in flight, narrower
# ones make more programs for the GPU's SMs; shorter K blocks keep a tile of 64 rows in registers;
# blocks of fewer than 16 outputs are for the one-row reduction alone (`_one_row_tiles`).
CONFIGS = [
    triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w)
    for o, k, w in (
        (16, 256, 4), (16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 128, 4), (16, 128, 4), (32, 128, 4),
        (8, 256, 4), (8, 512, 4), (4, 512, 4), (4, 1024, 4), (8, 1024, 8),
    )
]  # fmt: skip


def fits(x: torch.Tensor, *weights) -> bool:
    """Whether `gemv` takes these operands (else use F.linear): dense weights of x's dtype, or
    QuantizedWeights of one format standing for it."""
    kinds = {w.format if isinstance(w, QuantizedWeight) else "dense" for w in weights}
    return (
        not torch.is_grad_enabled()
        and use_triton(x)
        and 0 < x.shape[0] <= MAX_ROWS
        and len(weights) <= 3
        and len(kinds) == 1
        and all(
            (
                type(w) in (torch.Tensor, torch.nn.Parameter)
                and w.is_contiguous()
                or isinstance(w, QuantizedWeight)
                and w.codes.is_contiguous()
                and w.scales.is_contiguous()
            )
            and w.dtype == x.dtype
            and w.dim() == 2
            and w.shape[1] == x.shape[1]
            for w in weights
        )
    )


def gemv_reference(x: torch.Tensor, weights: list) -> list[torch.Tensor]:
    """x @ w.T for each weight, a quantized one dequantized to x's dtype first."""
    return [x @ w.to(x.dtype).T for w in weights]


def gemv(x: torch.Tensor, weights: list) -> list[torch.Tensor]:
    """x [M, K] -> [x @ w.T for w in weights] (Triton; see `fits`)."""
    x = x.contiguous()
    rows, inner = x.shape
    outs = [x.new_empty(rows, w.shape[0]) for w in weights]
    sizes = [w.shape[0] for w in weights] + [0] * (3 - len(weights))
    operands = [kernel_operands(w, x.dtype) for w in weights]
    operands += [operands[0]] * (3 - len(weights))  # unused slots: no program reads them
    outs_padded = outs + [outs[0]] * (3 - len(outs))
    aligned = all(o[4]["ALIGNED"] for o in operands)

    def grid(meta):
        return (sum(triton.cdiv(n, meta["BLOCK_OUT"]) for n in sizes),)

    _gemv_kernel[grid](
        x,
        *(o[0] for o in operands),
        *(o[1] for o in operands),
        *outs_padded,
        *sizes,
        *(o[2] for o in operands),
        *(o[3] for o in operands),
        rows,
        inner,
        triton.next_power_of_2(rows),
        ROWS=1 if rows == 1 and ONE_ROW_REDUCTION else max(16, triton.next_power_of_2(rows)),  # tl.dot's least
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        PREFETCH=PREFETCH_WEIGHTS,
        **{**operands[0][4], "ALIGNED": aligned},
        **dependent_launch(x),
    )
    return outs


ROW_CONFIGS = row_configs()  # one row on a quantized weight (quantized_weight.ROW_TILES)
_by_format = tiles_by_format(CONFIGS, ROW_CONFIGS, one_row=lambda args: args["ROWS"] == 1)


def _one_row_tiles(configs, named_args, **kwargs):
    """Blocks of fewer than 16 outputs only for the one-row reduction (tl.dot's least is 16); a
    quantized weight's one row on its own tiles."""
    configs = _by_format(configs, named_args, **kwargs)
    if kwargs.get("ROWS", named_args.get("ROWS")) == 1:
        return configs
    return [c for c in configs if c.kwargs["BLOCK_OUT"] >= 16]


@tuned(CONFIGS + ROW_CONFIGS, key=["n0", "n1", "n2", "inner", "size_class", "ROWS", "FORMAT"], prune=_one_row_tiles)
@triton.jit
def _gemv_kernel(
    x_ptr,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    s0_ptr,
    s1_ptr,
    s2_ptr,
    out0_ptr,
    out1_ptr,
    out2_ptr,
    n0,
    n1,
    n2,
    stride0,
    stride1,
    stride2,
    offset0,
    offset1,
    offset2,
    rows,
    inner,
    size_class,
    ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
    PREFETCH: tl.constexpr,
    FORMAT: tl.constexpr,  # 0: dense weights; 1: fp8, 2: mxfp4 (quantized_weight.load_rows)
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    GDC: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if not PREFETCH or (ROWS == 1 and FORMAT != 0):
        wait_for_inputs(GDC)
    block = tl.program_id(0)
    first1 = tl.cdiv(n0, BLOCK_OUT)  # the first block of weight 1, then of weight 2
    first2 = first1 + tl.cdiv(n1, BLOCK_OUT)
    if block < first1:  # this program's weight
        w_ptr, s_ptr, out_ptr = w0_ptr, s0_ptr, out0_ptr
    elif block < first2:
        w_ptr, s_ptr, out_ptr = w1_ptr, s1_ptr, out1_ptr
    else:
        w_ptr, s_ptr, out_ptr = w2_ptr, s2_ptr, out2_ptr
    n = tl.where(block < first1, n0, tl.where(block < first2, n1, n2))
    stride = tl.where(block < first1, stride0, tl.where(block < first2, stride1, stride2))
    offset = tl.where(block < first1, offset0, tl.where(block < first2, offset1, offset2))
    start = tl.where(block < first1, 0, tl.where(block < first2, first1, first2))
    cols = (block - start) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    if ROWS == 1 and FORMAT != 0:  # one row on a quantized weight: products in a register tile
        rows64 = cols.to(tl.int64)
        acc = row_products(
            w_ptr, s_ptr, x_ptr, rows64, cols < n, 0, inner, stride, offset, FORMAT, ALIGNED, COMPILED, BLOCK_K
        )
        for k0 in range(BLOCK_K, inner, BLOCK_K):
            acc += row_products(
                w_ptr, s_ptr, x_ptr, rows64, cols < n, k0, inner, stride, offset, FORMAT, ALIGNED, COMPILED, BLOCK_K
            )
        total = tl.sum(acc, axis=1)
        tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cols < n)
        return
    m = tl.arange(0, ROWS)
    x_rows = x_ptr + m[:, None] * inner
    w_rows = w_ptr + cols[None, :].to(tl.int64) * inner  # [BLOCK_K, BLOCK_OUT] tiles of the weight
    ks = tl.arange(0, BLOCK_K)  # the first block of K, then the rest in a loop
    if FORMAT == 0:
        w = tl.load(w_rows + ks[:, None], mask=(cols[None, :] < n) & (ks[:, None] < inner), other=0.0)
    else:  # the block's codes and scales, decoded in registers
        w = _quantized_block(
            w_ptr, s_ptr, cols, n, 0, inner, stride, offset, FORMAT, ALIGNED, COMPILED, ROUND_BF16, BLOCK_K
        ).to(x_ptr.dtype.element_ty)
    if PREFETCH:  # that block of weights read, now the input
        wait_for_inputs(GDC)
    acc = _block_product(x_rows + ks[None, :], (m[:, None] < rows) & (ks[None, :] < inner), w, ROWS, PRECISION)
    for k0 in range(BLOCK_K, inner, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if FORMAT == 0:
            w = tl.load(w_rows + ks[:, None], mask=(cols[None, :] < n) & (ks[:, None] < inner), other=0.0)
        else:
            w = _quantized_block(
                w_ptr, s_ptr, cols, n, k0, inner, stride, offset, FORMAT, ALIGNED, COMPILED, ROUND_BF16, BLOCK_K
            ).to(x_ptr.dtype.element_ty)
        acc += _block_product(x_rows + ks[None, :], (m[:, None] < rows) & (ks[None, :] < inner), w, ROWS, PRECISION)
    tl.store(
        out_ptr + m[:, None] * n + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(m[:, None] < rows) & (cols[None, :] < n),
    )


@triton.jit
def _quantized_block(
    w_ptr,
    s_ptr,
    cols,
    n,
    k0,
    inner,
    stride,
    offset,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[BLOCK_K, BLOCK_OUT] of a quantized weight's rows `cols`, decoded, in x's dtype."""
    value = load_rows(
        w_ptr,
        s_ptr,
        cols.to(tl.int64),
        cols < n,
        k0,
        inner,
        stride,
        offset,
        FORMAT,
        ALIGNED,
        COMPILED,
        ROUND_BF16,
        BLOCK_K,
    )
    return tl.trans(value)


@triton.jit
def _block_product(x_at, x_mask, w, ROWS: tl.constexpr, PRECISION: tl.constexpr):
    """x [ROWS, BLOCK_K] (loaded from x_at) @ w [BLOCK_K, BLOCK_OUT] in fp32: one row as products
    summed over K (no tl.dot, so any BLOCK_OUT), more by tl.dot."""
    xs = tl.load(x_at, mask=x_mask, other=0.0)
    if ROWS == 1:
        return tl.sum(w.to(tl.float32) * tl.reshape(xs, [xs.shape[1], 1]).to(tl.float32), axis=0)[None, :]
    return tl.dot(xs, w, input_precision=PRECISION)
