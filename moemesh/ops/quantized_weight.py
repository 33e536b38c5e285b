"""A frozen weight kept in its published quantized form, dequantized when a product needs it.

Why: a LoRA run on a quantized checkpoint (gpt-oss in MXFP4, DeepSeek-V3 or Qwen3-FP8 in block
FP8) trains adapters only; its base is read-only, so it can stay in the bytes it was published in
(a quarter or half of bf16's) and be dequantized per product, in the forward and again for the
input's gradient in backward. It has no weight gradient. The products that take a base weight
(`ops/linear.py`, `ops/grouped_mm.py`) call `weight.to(dtype)` on it, which for a `QuantizedWeight`
is `dequantize`: the same dense tensor the checkpoint's formula gives (`checkpoint/quantized.py`),
in the compute dtype, alive for one product. So a run on the quantized base computes exactly what
the same run on the base dequantized to that dtype computes.

Formats, per row (a rank's block of a tensor need not start on a tile row, so the scales of each
row are kept; for block FP8 that is 128 times the tile grid's scales, under 3% of the codes):
  fp8    codes e4m3 [..., R, C] and fp32 scales [..., R, ceil((offset + C) / 128)]: element (r, c)
         is code * scales[r, (offset + c) // 128]; `offset` is where the block's first column
         sits in its 128-wide tile (a TP slice that cuts a tile)
  mxfp4  blocks U8 [..., R, C/32, 16] (two E2M1 codes a byte, element 2j low) and E8M0 scales U8
         [..., R, C/32]: element (r, 32g + j) is E2M1[code] * 2^(scales[r, g] - 127)
The kernel (`_dequantize_kernel`) decodes both from their bits in fp32 and writes the result in the
output's dtype; `dequantize_reference` is the torch formula. Both give the fp32 product rounded
once, so they agree bit for bit.

The decoding kernels (`ops/gemv.py`, `ops/expert_gemv.py`) read a QuantizedWeight as it is: each
tile of codes with its scales loaded and decoded in registers, in fp32 — for a block of rows
(`load_rows`) rounded to the weight's dtype as `dequantize` rounds it and multiplied as the dense
weight's tile would be, for one row (`row_products`, below) multiplied unrounded
(`kernel_operands` gives a kernel its pointers and constants). A decode step so reads a quarter
(MXFP4) or half (FP8) of bf16's bytes of each weight; on an H200 the one-row kernels read FP8 at
37-40% of a copy's bandwidth and MXFP4 at 13-19% (bench/kernels/ops.py --quantized-gemv,
2026-12-02), bf16's at 60-80%.

Limits: frozen only (no gradient, no optimizer); not a torch.Tensor: FSDP does not shard it and
distributed checkpoints do not save it (a LoRA run saves adapters only). A grouped GEMM
dequantizes its whole bank for the product (one layer's bank in the compute dtype at a time),
except a forward's over an FP8 bank on a GPU, which decodes the tiles itself
(`ops/quantized_grouped_mm.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moemesh.ops import recompute
from moemesh.ops.backend import tl, triton, use_triton

FP8_TILE = 128  # block FP8's tile width (and height) in the published checkpoints
MX_GROUP = 32  # elements per MXFP4 scale
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# E8M0: byte b is 2^(b - 127) (b = 0: 2^-127, an fp32 subnormal, exact), 255 is NaN
E8M0 = torch.tensor([math.ldexp(1.0, b - 127) for b in range(255)] + [math.nan], dtype=torch.float32)
FORMATS = ("fp8", "mxfp4")


@dataclass
class QuantizedWeight:
    """A weight of dense shape `shape` in `format` (module docstring), standing for a tensor of
    `dtype`: what `.to(dtype)` returns."""

    format: str
    codes: torch.Tensor  # fp8: e4m3 [..., R, C]; mxfp4: U8 blocks [..., R, C/32, 16]
    scales: torch.Tensor  # fp8: fp32 [..., R, tiles]; mxfp4: U8 [..., R, C/32]
    dtype: torch.dtype = torch.bfloat16
    offset: int = 0  # fp8: the first column's place in its tile
    requires_grad = False

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"a quantized weight is one of {FORMATS}, not {self.format!r}")
        if self.format == "fp8":
            rows, cols = self.codes.shape[-2:]
            tiles = -(-(self.offset + cols) // FP8_TILE)
            if self.codes.dtype != torch.float8_e4m3fn or self.scales.shape != (*self.codes.shape[:-1], tiles):
                raise ValueError(
                    f"fp8 codes {tuple(self.codes.shape)} ({self.codes.dtype}) need e4m3 codes and fp32 scales "
                    f"{(*self.codes.shape[:-1], tiles)}, got {tuple(self.scales.shape)}"
                )
            self.shape = self.codes.shape
        else:
            if self.codes.dtype != torch.uint8 or self.codes.shape[:-1] != self.scales.shape:
                raise ValueError(
                    f"mxfp4 blocks {tuple(self.codes.shape)} and scales {tuple(self.scales.shape)} do not fit"
                )
            self.shape = torch.Size((*self.codes.shape[:-2], self.codes.shape[-2] * MX_GROUP))

    # ---- what the products read of a weight -------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def is_cuda(self) -> bool:
        return self.codes.is_cuda

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight in `dtype` (the one products call)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError("a quantized weight is converted to a dtype only (it stays on its device)")
        return dequantize(self, dtype)

    def experts(self, ids: torch.Tensor) -> QuantizedWeight:
        """The entries `ids` of the leading dim (an expert bank's experts)."""
        return QuantizedWeight(self.format, self.codes[ids], self.scales[ids], self.dtype, self.offset)

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.format}, shape={tuple(self.shape)}, stands for {self.dtype})"


def kernel_operands(weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, int, dict]:
    """What a decoding kernel takes of `weight` (a tensor, or a QuantizedWeight standing for one of
    `dtype`): (codes, scales, the scales' row stride, the fp8 column offset, the constexprs of
    `load_rows`). A dense weight is its own codes (FORMAT 0: read as it is, the scales unused)."""
    if not isinstance(weight, QuantizedWeight):
        return weight, weight, 0, 0, {"FORMAT": 0, "ALIGNED": False, "COMPILED": False, "ROUND_BF16": False}
    codes = weight.codes.view(torch.uint8) if weight.format == "fp8" else weight.codes
    constants = {
        "FORMAT": 1 if weight.format == "fp8" else 2,
        "ALIGNED": weight.offset == 0,
        "COMPILED": weight.is_cuda,
        "ROUND_BF16": dtype == torch.bfloat16,
    }
    return codes, weight.scales, weight.scales.shape[-1], weight.offset, constants


def is_quantized(weight) -> bool:
    return isinstance(weight, QuantizedWeight)


def for_backward(x: torch.Tensor, weight) -> tuple[torch.Tensor | None, object]:
    """(what a product's autograd node saves of its frozen `weight` for backward, the weight its
    forward multiplies). A quantized weight inside an activation-checkpointed region is
    dequantized once for the recomputation and backward both: the recomputation multiplies the
    dense weight and saves it, so backward does not dequantize again (it lives from the layer's
    recomputation to its backward). The region's first run saves a stand-in of the dense
    weight's shape and dtype that holds no memory — torch's checkpoint keeps nothing a first run
    saves and compares only those — and multiplies `weight` itself. Elsewhere nothing is saved
    (backward dequantizes again: holding a dense copy a layer would cost what quantizing saved)."""
    if not isinstance(weight, QuantizedWeight) or not recompute.checkpointing():
        return None, weight
    if not recompute.recomputing():
        return x.new_empty(()).expand(weight.shape), weight
    dense = weight.to(x.dtype)
    return dense, dense


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense weight in `dtype`: the Triton kernel where Triton runs, else the reference."""
    if use_triton(weight.codes):
        return dequantize_triton(weight, dtype)
    return dequantize_reference(weight, dtype)


def dequantize_reference(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The published formulas in fp32, then `dtype`."""
    if weight.format == "fp8":
        cols = weight.shape[-1]
        scale = weight.scales.repeat_interleave(FP8_TILE, -1)[..., weight.offset : weight.offset + cols]
        return (weight.codes.float() * scale).to(dtype)
    blocks, scales = weight.codes, weight.scales
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # element 2j low, 2j+1 high
    values = E2M1.to(blocks.device)[codes] * E8M0.to(blocks.device)[scales.long()].unsqueeze(-1)
    return values.flatten(-2).to(dtype)


# ---- the kernel --------------------------------------------------------------------------------
# A program's tile (rows, columns, warps): measured on an H200 (bench/kernels/ops.py
# --dequantize-tiles, 2026-12-02), the Qwen3-30B-A3B gate_up bank in FP8 at 3.98 TB/s (94% of a
# copy) in rows of 2,048 (8 x 1,024: 3.80, 89%), gpt-oss-120b's in MXFP4 at 2.9 (68%) in 8 x 1,024
# (2,048 wide: 2.2); 16 x 128 x 4 warps gave 3.2 and 2.2; reading each scale per element, 2.5 and
# 1.4. Narrower FP8 rows (the down bank's 768) keep 8 x 1,024: a 2,048-wide block would mask most.
_TILE, _WIDE_FP8_TILE = (8, 1024, 8), (4, 2048, 4)


def dequantize_triton(
    weight: QuantizedWeight, dtype: torch.dtype, tile: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """The kernel; `tile`: (rows, columns, warps) a program (bench/kernels/ops.py --dequantize-tiles)."""
    *lead, cols = weight.shape
    block_rows, block_cols, warps = tile or (_WIDE_FP8_TILE if weight.format == "fp8" and cols >= 2048 else _TILE)
    rows = math.prod(lead)
    out = torch.empty(*lead, cols, dtype=dtype, device=weight.device)
    if out.numel() == 0:
        return out
    codes = weight.codes.reshape(rows, -1)
    if weight.format == "fp8":
        codes = codes.view(torch.uint8)
    scales = weight.scales.reshape(rows, -1)
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
    _dequantize_kernel[grid](
        codes,
        scales,
        out.view(rows, cols),
        rows,
        cols,
        codes.stride(0),
        scales.stride(0),
        weight.offset,
        MXFP4=weight.format == "mxfp4",
        ROUND_BF16=dtype == torch.bfloat16,
        COMPILED=weight.is_cuda,
        ALIGNED=weight.offset == 0 and block_cols % FP8_TILE == 0,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        num_warps=warps,
    )
    return out


@triton.jit
def _e4m3(bits):
    """e4m3fn bits (int32 0-255) -> fp32, exactly: normal 2^(e-7)(1 + m/8), subnormal m 2^-9,
    S.1111.111 NaN."""
    sign = bits >> 7
    exponent = (bits >> 3) & 15
    mantissa = bits & 7
    normal = ((sign << 31) | ((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    subnormal = tl.where(sign == 1, -1.0, 1.0) * mantissa.to(tl.float32) * 0.001953125
    value = tl.where(exponent == 0, subnormal, normal)
    return tl.where((exponent == 15) & (mantissa == 7), float("nan"), value)


@triton.jit
def _e2m1(code):
    """E2M1 codes (int32 0-15) -> fp32: 0, .5 (m < 2: m/2), else 2^(m/2 - 1)(1 + (m odd)/2)."""
    magnitude = code & 7
    low = magnitude.to(tl.float32) * 0.5
    high = (((magnitude >> 1) + 126) << 23).to(tl.float32, bitcast=True) * (1.0 + (magnitude & 1).to(tl.float32) * 0.5)
    value = tl.where(magnitude < 2, low, high)
    return tl.where(code >= 8, -value, value)


@triton.jit
def _e8m0(exponent):
    """E8M0 bytes (int32) -> 2^(b - 127) from its bits: b << 23; b = 0 the subnormal 2^-127 (bit
    22: 2^22 x 2^-149); 255 NaN."""
    scale = tl.where(exponent == 0, 1 << 22, exponent << 23).to(tl.float32, bitcast=True)
    return tl.where(exponent == 255, float("nan"), scale)


@triton.jit
def _round_bf16(value):
    """fp32 -> the nearest bf16 (ties to even), still fp32: Triton's interpreter truncates."""
    bits = value.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def load_rows(
    codes_ptr,
    scales_ptr,
    rows,
    row_mask,
    k0,
    inner,
    scale_stride,
    offset,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[R, BLOCK_K] fp32: the columns k0 .. k0 + BLOCK_K - 1 of the rows `rows` ([R] int64, rows of
    the weight flattened to [rows, inner]; an expert bank's expert e, row r is e * R + r) of a
    quantized weight, decoded in registers (0 outside `row_mask` and past `inner`), rounded to bf16
    where the weight stands for bf16. FORMAT 1: fp8 codes [rows, inner] as bytes, fp32 scales
    [rows, scale_stride], column c's at (offset + c) // 128 (ALIGNED: offset 0, k0 a multiple of
    BLOCK_K, so a tile's scale is read once and broadcast); FORMAT 2: mxfp4 bytes [rows, inner / 2],
    E8M0 scales [rows, inner / 32] (BLOCK_K a multiple of 32)."""
    if FORMAT == 2:  # each byte read once for its two codes, each group's scale once
        pair = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(
            codes_ptr + rows[:, None] * (inner // 2) + pair[None, :],
            mask=row_mask[:, None] & (pair[None, :] < inner // 2),
            other=0,
        ).to(tl.int32)
        group = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        exponent = tl.load(
            scales_ptr + rows[:, None] * (inner // 32) + group[None, :],
            mask=row_mask[:, None] & (group[None, :] < inner // 32),
            other=127,
        ).to(tl.int32)
        values = tl.reshape(tl.join(_e2m1(byte & 15), _e2m1(byte >> 4)), (rows.shape[0], BLOCK_K // 32, 32))
        value = tl.reshape(values * _e8m0(exponent)[:, :, None], (rows.shape[0], BLOCK_K))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        mask = row_mask[:, None] & (ks[None, :] < inner)
        bits = tl.load(codes_ptr + rows[:, None] * inner + ks[None, :], mask=mask, other=0)
        if COMPILED:  # the GPU's conversion (exact: every e4m3 is an fp32)
            value = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            value = _e4m3(bits.to(tl.int32))
        if ALIGNED and BLOCK_K >= 128:  # whole tiles: each one's scale read once, broadcast
            tile = k0 // 128 + tl.arange(0, BLOCK_K // 128)
            scale = tl.load(
                scales_ptr + rows[:, None] * scale_stride + tile[None, :],
                mask=row_mask[:, None] & (tile[None, :] < scale_stride),
                other=1.0,
            )
            value = tl.reshape(
                tl.reshape(value, (rows.shape[0], BLOCK_K // 128, 128)) * scale[:, :, None], (rows.shape[0], BLOCK_K)
            )
        elif ALIGNED:  # the block inside one tile: one scale a row
            scale = tl.load(scales_ptr + rows * scale_stride + k0 // 128, mask=row_mask, other=1.0)
            value = value * scale[:, None]
        else:  # a column offset (a TP slice cutting a tile): each column's tile
            value = value * tl.load(
                scales_ptr + rows[:, None] * scale_stride + (ks[None, :] + offset) // 128, mask=mask, other=1.0
            )
    if ROUND_BF16 and not COMPILED:
        value = _round_bf16(value)
    return value


@triton.jit
def _dequantize_kernel(
    codes_ptr,
    scales_ptr,
    out_ptr,
    rows,
    cols,
    code_stride,
    scale_stride,
    offset,
    MXFP4: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    COMPILED: tl.constexpr,  # for a GPU, not the interpreter
    ALIGNED: tl.constexpr,  # fp8: no column offset, BLOCK_COLS a multiple of the tile
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row[:, None] < rows) & (col[None, :] < cols)
    row64 = row.to(tl.int64)[:, None]
    if MXFP4:  # each byte read once for its two codes, each group's scale once
        pair = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
        byte = tl.load(
            codes_ptr + row64 * code_stride + pair[None, :], mask=(row[:, None] < rows) & (pair[None, :] < cols // 2)
        ).to(tl.int32)
        group = tl.program_id(1) * (BLOCK_COLS // 32) + tl.arange(0, BLOCK_COLS // 32)
        exponent = tl.load(
            scales_ptr + row64 * scale_stride + group[None, :],
            mask=(row[:, None] < rows) & (group[None, :] < cols // 32),
            other=127,
        ).to(tl.int32)
        values = tl.reshape(tl.join(_e2m1(byte & 15), _e2m1(byte >> 4)), (BLOCK_ROWS, BLOCK_COLS // 32, 32))
        value = tl.reshape(values * _e8m0(exponent)[:, :, None], (BLOCK_ROWS, BLOCK_COLS))
    else:
        bits = tl.load(codes_ptr + row64 * code_stride + col[None, :], mask=mask, other=0)
        if COMPILED:  # the GPU's conversion (exact: every e4m3 is an fp32)
            value = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            value = _e4m3(bits.to(tl.int32))
        if ALIGNED:  # the block's columns start on a tile: each tile's scale read once, broadcast
            tile = tl.program_id(1) * (BLOCK_COLS // 128) + tl.arange(0, BLOCK_COLS // 128)
            scale = tl.load(
                scales_ptr + row64 * scale_stride + tile[None, :],
                mask=(row[:, None] < rows) & (tile[None, :] < tl.cdiv(cols, 128)),
                other=1.0,
            )
            value = tl.reshape(
                tl.reshape(value, (BLOCK_ROWS, BLOCK_COLS // 128, 128)) * scale[:, :, None], (BLOCK_ROWS, BLOCK_COLS)
            )
        else:
            value *= tl.load(scales_ptr + row64 * scale_stride + (col[None, :] + offset) // 128, mask=mask, other=1.0)
    if ROUND_BF16 and not COMPILED:  # to nearest even by hand: Triton's interpreter truncates
        bits = value.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        value = bits.to(tl.float32, bitcast=True)
    tl.store(out_ptr + row64 * cols + col[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


# ---- one row of activations times rows of a quantized weight -------------------------------------
# A decode step of one token multiplies one activation row by each weight: a reduction over K, not
# a tl.dot. `row_products` gives a block of K's products for rows of the weight summed by runs of
# 8 columns, [R, runs]: a run lies inside one scale's block (fp8's 128-wide tile, mxfp4's 32-group)
# and in one thread's registers, so its exact products are added there and scaled once (a multiply
# a run, not one a product: 171 instructions an iteration of the (4, 1024, 4) FP8 tile compiled for
# sm90 became 155, and its [R, runs, 8] accumulator of 72 registers a thread [R, runs], 40); a kernel
# adds the run sums up in a register tile of that shape, summing across threads once at the end. (The
# earlier form, `load_rows` transposed for a sum over K a block, moved each block through shared
# memory with ten barriers an iteration: 68 GB/s for FP8 q, k, v at batch 1 on an H200.)
# The weights are not rounded to bf16 here: the products are of the exact decoded values, in fp32.
#
# Its tiles (ROW_TILES: rows a program, BLOCK_K, warps) read a multiple of 256 x warps columns a
# step: then each thread holds runs of 8 bytes of codes (fp8: 8 columns; mxfp4: 4 bytes, 8
# columns) beside the same columns of x, one load each, the layout of both the same. Any other
# width put x in a layout of its own, moved through shared memory with barriers every step of K
# (counted in the kernels compiled for sm90); more than 8 rows a program take over 128 registers a
# thread. Two or four runs a thread keep more bytes in flight (an H200's one-run tiles read FP8
# at 37-40% of a copy with run sums (35% before), bf16's tiles at 61-78%: bench/kernels/ops.py
# --quantized-gemv, 2026-12-02).
#
# What bounds them, counted in the loops compiled for sm90 (Triton 3.9, the row length divisible by
# 16 as launches specialize it; 2026-12-03): an H200 streams ~16 bytes a clock an SM and issues 128
# thread-instructions, ~8 a byte. FP8's loops take 4.4-5.9 a byte, so they are not bound by their
# instructions; MXFP4's 15-17 (the nibbles' decoding, the conversions to fp32, an FMA each), so at
# most ~half the bandwidth. A bf16 lookup of each nibble by `prmt` in inline PTX (15-18) and
# `tl.dot_scaled` over 16 padded rows (13-20) counted no fewer; products on the tensor cores of
# nibbles decoded straight to bf16 would drop the FMAs and the conversions (not built).
ROW_TILES = [
    (2, 1024, 4),
    (4, 1024, 4),
    (8, 1024, 4),
    (4, 512, 2),
    (4, 1024, 2),
    (2, 2048, 2),
    (2, 1024, 1),
    (4, 512, 1),
]


def row_configs() -> list:
    """ROW_TILES as the autotuner's configs (backend.tuned)."""
    return [triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w) for o, k, w in ROW_TILES]


def tiles_by_format(dense: list, quantized: list, one_row=lambda kwargs: True):
    """A `tuned` prune: the configs of `dense` for dense weights (FORMAT 0), those of `quantized`
    for a quantized weight's one-row products (`one_row(kwargs)`), else `dense` again."""

    def prune(configs, named_args, **kwargs):
        fmt = kwargs.get("FORMAT", named_args.get("FORMAT"))
        chosen = quantized if fmt and one_row({**named_args, **kwargs}) else dense
        return [c for c in configs if any(c is mine for mine in chosen)]  # (a Config equals its copies)

    return prune


@triton.jit
def row_products(
    codes_ptr,
    scales_ptr,
    x_ptr,
    rows,
    row_mask,
    k0,
    inner,
    scale_stride,
    offset,
    FORMAT: tl.constexpr,
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """[R, BLOCK_K / 8] fp32: for each run of 8 columns c in k0 .. k0 + BLOCK_K - 1, the sum of
    weight[r, c] * x[c] over the run, for the rows `rows` ([R] int64 of the weight flattened to
    [rows, inner]; 0 outside `row_mask` and past `inner`), x read at x_ptr (one row of `inner`);
    k0 a multiple of BLOCK_K, BLOCK_K of 8 (fp8; ALIGNED: no column offset, so a run has one
    scale) or of 32 (mxfp4). A run lies in one scale's block: its exact products are summed in
    registers, then scaled once."""
    if FORMAT == 2:
        products = _mxfp4_products(codes_ptr, scales_ptr, x_ptr, rows, row_mask, k0, inner, COMPILED, BLOCK_K)
    else:
        products = _fp8_products(
            codes_ptr, scales_ptr, x_ptr, rows, row_mask, k0, inner, scale_stride, offset, ALIGNED, COMPILED, BLOCK_K
        )
    return products


@triton.jit
def _mxfp4_products(
    codes_ptr, scales_ptr, x_ptr, rows, row_mask, k0, inner, COMPILED: tl.constexpr, BLOCK_K: tl.constexpr
):  # fmt: skip
    """row_products of mxfp4: runs of 4 bytes (8 columns), [R, BLOCK_K / 8, 4] products (each
    byte's two added) summed over the run, then scaled (a power of two: exactly). x in bf16 is
    read as 32-bit words of two elements, the even one the low half (an element's fp32 is its bits
    shifted up 16): 16 bytes of x beside each 4 bytes of codes, one load each, in the same layout."""
    run = tl.arange(0, BLOCK_K // 8)
    pair = k0 // 2 + run[:, None] * 4 + tl.arange(0, 4)[None, :]  # [runs, 4]: bytes, and x's pairs
    in_k = pair < inner // 2
    byte = tl.load(
        codes_ptr + rows[:, None, None] * (inner // 2) + pair[None, :, :],
        mask=row_mask[:, None, None] & in_k[None, :, :],
        other=0,
    ).to(tl.int32)
    group = (k0 + run * 8) // 32
    exponent = tl.load(
        scales_ptr + rows[:, None] * (inner // 32) + group[None, :],
        mask=row_mask[:, None] & (group[None, :] < inner // 32),
        other=127,
    ).to(tl.int32)
    scale = _e8m0(exponent) * 16384.0  # [R, runs]; 2^14: what the nibbles' decoding leaves out
    if x_ptr.dtype.element_ty == tl.bfloat16:
        word = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + pair[None, :, :], mask=in_k[None, :, :], other=0)
        even = (word << 16).to(tl.float32, bitcast=True)
        odd = (word & -65536).to(tl.float32, bitcast=True)
    else:
        even = tl.load(x_ptr + 2 * pair[None, :, :], mask=in_k[None, :, :], other=0.0).to(tl.float32)
        odd = tl.load(x_ptr + 2 * pair[None, :, :] + 1, mask=in_k[None, :, :], other=0.0).to(tl.float32)
    if COMPILED:  # each nibble's three magnitude bits at an fp16's bits 9-11, its sign at bit 15:
        # 2^(e-15)(1 + m/2), or m 2^-15 a subnormal fp16 for e = 0, exact (2^-14 of E2M1's value);
        # both nibbles of a byte in one word first (low at bits 0-3, high at 16-19)
        both = byte | (byte << 12)
        halves = ((both & 0x70007) << 9) | ((both & 0x80008) << 12)
        low = (halves & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        high = (halves >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:  # the interpreter: the same values from the table
        low, high = _e2m1(byte & 15) * 0.00006103515625, _e2m1(byte >> 4) * 0.00006103515625
    return tl.sum(low * even + high * odd, axis=2) * scale


@triton.jit
def _fp8_products(
    codes_ptr, scales_ptr, x_ptr, rows, row_mask, k0, inner, scale_stride, offset,
    ALIGNED: tl.constexpr, COMPILED: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """row_products of fp8: runs of 8 columns (8 bytes of codes, 8 of x's elements in 16: one
    load each, in the same layout), [R, BLOCK_K / 8, 8] exact products summed over the run, then
    times the run's scale (ALIGNED; else each product times its column's, then summed)."""
    run = tl.arange(0, BLOCK_K // 8)
    column = k0 + run[:, None] * 8 + tl.arange(0, 8)[None, :]  # [runs, 8]
    in_cols = column < inner
    mask = row_mask[:, None, None] & in_cols[None, :, :]
    bits = tl.load(codes_ptr + rows[:, None, None] * inner + column[None, :, :], mask=mask, other=0)
    if COMPILED:  # the GPU's conversion (exact: every e4m3 is an fp32)
        value = bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        value = _e4m3(bits.to(tl.int32))
    xs = tl.load(x_ptr + column[None, :, :], mask=in_cols[None, :, :], other=0.0).to(tl.float32)
    if ALIGNED:  # a run's one scale a row (128 is a multiple of 8)
        tile = (k0 + run * 8) // 128
        scale = tl.load(
            scales_ptr + rows[:, None] * scale_stride + tile[None, :],
            mask=row_mask[:, None] & (tile[None, :] < scale_stride),
            other=1.0,
        )
        return tl.sum(value * xs, axis=2) * scale
    scale = tl.load(
        scales_ptr + rows[:, None, None] * scale_stride + (column[None, :, :] + offset) // 128, mask=mask, other=1.0
    )
    return tl.sum(value * xs * scale, axis=2)
