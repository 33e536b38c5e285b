"""The grouped GEMM of a forward over an FP8 expert bank, each weight tile decoded in registers.

Why: a LoRA step on a block-FP8 base (`ops/quantized_weight.py`) otherwise dequantizes each
bank to bf16 before torch's grouped GEMM reads it, and a dequantization moves 1.5x the bank's
bf16 bytes (codes read, bf16 written). This kernel reads the codes instead: every [BLOCK_N,
BLOCK_K] tile of W_e is loaded as bytes with its rows' scales, decoded and rounded to bf16 as
`dequantize` rounds it (`load_rows`), and fed to `tl.dot` beside x's rows of expert e. The dense
weight it multiplies is the one `dequantize` gives, so the products are those of the dense bank
(bit for bit against torch's grouped GEMM on the measured shapes below; fp32 accumulation
either way).

Where it is used: the products of a forward that need no dense bank afterwards (`grouped_mm.
base_product`): the first run of a checkpointed layer (its recomputation dequantizes once, for
itself and for backward: `grouped_mm.shared_bank`), and forwards without gradients. So a step of
the LoRA recipe dequantizes each FP8 bank once, not twice.

Measured on one H200 (bench/kernels/ops.py --dequantize-tiles, 2026-12-02), 4,096 tokens top-8
of the Qwen3-30B-A3B shape (128 experts, routing skewed as a trained router's): gate_up 669 us
(308 TFLOP/s) against 744 us of dequantization + grouped GEMM, down 358 against 404, bit for bit
the same (a prototype's run that day: 623 and 339 against 748 and 397). Not used where it
measured slower: the input gradient's product (a variant reading W_e untransposed, that day: gate_up
731 us against the dense grouped GEMM's 437 on the bank backward holds anyway), and MXFP4 banks (the
nibbles' decoding: gpt-oss-120b's gate_up 4.42 ms against 3.72).

Its limit: compiled for sm90 the loop converts a step of K's tile (~270 instructions a thread: fp8
to fp32, the scale, to bf16, then through shared memory) and waits for that step's wgmma before
the next, so conversion and MMA do not overlap — ~310 TFLOP/s where torch's grouped GEMM of the
dense bank gives ~480. A thread's conversion is already three instructions an element (e4m3
pairs to f16, f16 to fp32, the scale's multiply; bf16 pairs packed). What measured no faster
(bench/kernels/ops.py --dequantize-tiles and a register-capped variant, 2026-12-02, gate_up / down
against TILE's 657 / 336 us): a swapped form (out.T = W_e x.T, the decoded tile wgmma's A operand
from registers, one wgmma in flight while the next tile decodes; removed) 701 / 363 at 128 x 128
and 4 warps, 632 / 358 at 256 x 128 and 8 warps — it won only on an MXFP4 bank, where this kernel
is not used (gpt-oss-120b's gate_up at 128 x 64: 3.46 ms against dequantization + GEMM's 3.69);
4 stages 618 / 344 on one machine start and 686 / 349 on another (3: 673 / 348); 128-deep K steps
872 / 504; 2 stages capped at 168 registers a thread, so three programs share an SM, 739 / 378.
And writing the decoded bank from this kernel for backward (its recomputation's product filling
the dense bank as it goes, so no separate dequantization): gate_up 848 / down 434 us against
dequantization + GEMM's 823 / 400, and a whole LoRA step (bench/train/lora.py, 4,096 tokens, FP8
attention + experts, both in one call, 2026-12-02) 11,018 and 11,086 tokens/s against 11,230 and
11,247 without it — removed. Nor does a dequantization hide behind a GEMM on a second stream (a
prefetch of the next layer's dense bank, so that the first run could take torch's grouped GEMM):
the gate_up bank's dequantization (309 us) beside its dense GEMM (462 us) took 748 us, against
751 one after the other (bench/kernels/ops.py --dequantize-tiles' overlap rows, 2026-12-03): the
GEMM holds every SM.

Grid: one program per (M-tile of an expert, N-tile), M-tiles numbered expert after expert
(each expert's rows rounded up to BLOCK_M); the grid is sized for the most tiles any routing
can give (rows / BLOCK_M + experts), and programs past the last tile return. No host sync.
"""

from __future__ import annotations

import torch

from moemesh.ops.backend import INTERPRETED, tl, triton, use_triton
from moemesh.ops.quantized_weight import QuantizedWeight, kernel_operands, load_rows

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the fastest of bench/kernels/ops.py
# --dequantize-tiles on an H200 for both banks; the interpreter's is small, for the tests' speed.
TILE = (128, 128, 64, 4, 3)
INTERPRETED_TILE = (16, 64, 64, 4, 1)


def applies(x: torch.Tensor, weight) -> bool:
    """Whether x's product with the bank `weight` runs as this kernel: an FP8 bank [E, N, K] and
    x in bf16 or fp16 (fp32 under the interpreter), where the Triton kernels run
    (`backend.use_triton`)."""
    return (
        isinstance(weight, QuantizedWeight)
        and weight.format == "fp8"
        and weight.ndim == 3
        and (x.dtype in (torch.bfloat16, torch.float16) or not x.is_cuda)  # (a GPU's fp32 tl.dot: TF32)
        and use_triton(x)
    )


def quantized_grouped_mm(
    x: torch.Tensor, weight: QuantizedWeight, group_sizes: torch.Tensor, tile: tuple | None = None
) -> torch.Tensor:
    """[N, O]: out[rows of group e] = x[rows of group e] @ W_e.T for the bank W [E, O, K] (rows past
    the last group left unwritten, as torch's grouped GEMM leaves them); `tile` as TILE."""
    block_m, block_n, block_k, warps, stages = tile or (INTERPRETED_TILE if INTERPRETED else TILE)
    experts, out_cols, inner = weight.shape
    codes, scales, scale_stride, offset, constants = kernel_operands(weight, x.dtype)
    out = torch.empty(len(x), out_cols, dtype=x.dtype, device=x.device)
    n_tiles = triton.cdiv(out_cols, block_n)
    _kernel[((len(x) // block_m + experts) * n_tiles,)](
        x.contiguous(),
        codes,
        scales,
        out,
        torch.cumsum(group_sizes, 0, dtype=torch.int32),
        experts,
        out_cols,
        inner,
        scale_stride,
        offset,
        n_tiles,
        E_POW2=triton.next_power_of_2(experts),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
        **constants,
    )
    return out


@triton.jit
def _kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,
    group_ends_ptr,
    experts,
    out_cols,
    inner,
    scale_stride,
    offset,
    n_tiles,
    E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    tile = tl.program_id(0) // n_tiles
    n = (tl.program_id(0) % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    ids = tl.arange(0, E_POW2)
    ends = tl.load(group_ends_ptr + ids, mask=ids < experts, other=0)
    starts = tl.load(group_ends_ptr + ids - 1, mask=(ids > 0) & (ids < experts), other=0)
    tiles = tl.where(ids < experts, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.cumsum(tiles, 0)
    e = tl.sum((tile_ends <= tile).to(tl.int32))  # this program's expert (== experts: past the last tile)
    if e < experts:
        first = tl.sum(tl.where(ids == e, tile_ends - tiles, 0))
        start = tl.sum(tl.where(ids == e, starts, 0))
        end = tl.sum(tl.where(ids == e, ends, 0))
        m = start + (tile - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        m64 = m.to(tl.int64)
        x_rows = x_ptr + m64[:, None] * inner
        w_rows = e.to(tl.int64) * out_cols + n.to(tl.int64)  # rows of the bank flattened to [E * O, K]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inner, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w = load_rows(
                codes_ptr, scales_ptr, w_rows, n < out_cols, k0, inner, scale_stride, offset,
                FORMAT, ALIGNED, COMPILED, ROUND_BF16, BLOCK_K,
            )  # fmt: skip
            if COMPILED:  # (the interpreter's tl.dot misreads bf16: there the same products in fp32)
                w = w.to(x_ptr.dtype.element_ty)
            xs = tl.load(x_rows + ks[None, :], mask=(m[:, None] < end) & (ks[None, :] < inner), other=0.0).to(w.dtype)
            acc = tl.dot(xs, tl.trans(w), acc)
        tl.store(
            out_ptr + m64[:, None] * out_cols + n[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=(m[:, None] < end) & (n[None, :] < out_cols),
        )
