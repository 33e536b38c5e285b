"""Expert GEMV: each token times the weights of the experts it chose, reading only chosen weights.

    expert_gemv(x, weight, ids)[t·k + j] = weight[ids[t, j]] @ x[t]    x [T, K], weight [E, O, K],
                                                                       ids [T, k] -> [T·k, O]

For decoding, where a step has a few tokens: a grouped GEMM over the E experts pays for E mostly
empty groups, and the grouped path's sort, permute and combine for a handful of rows. Here each
chosen expert's weight is read once (the reference gathers the chosen matrices and runs one
batched matmul: it copies them, about three times the kernel's memory traffic). The Triton kernel
runs one program per (expert, block of outputs): it finds the (token, slot) pairs that chose its
expert by scanning the ids, then streams its block of the weight once per 16 of them (`tl.dot`
pads the rows to 16). `glu=True` fuses silu(gate)·up into the gate/up projection.

For the fewest tokens, two fused kernels run per token instead, so that a token's k experts cost
two launches and no separate weighted sum:

    expert_swiglu_gemv   a[t·k + j] = silu(gate) * up of weight[ids[t, j]] @ x[t]     -> [T·k, I]
    expert_gemv_combine  out[t] = Σ_j w[t, j] · weight[ids[t, j]] @ a[t·k + j]      -> [T, H]

They read an expert once per token that chose it, as good as once per expert while few tokens
share one; on an H200 a batch-1 step of the 48-layer Qwen3-30B-A3B shape takes 11% less time with
them than with the per-expert kernel, and batch 64 takes 35% less with the per-expert kernel than
with the grouped GEMM (docs/benchmarks.md).
`models/moe.py` picks by the number of (token, expert) pairs.

A rank that holds some of the experts (expert parallelism for decoding, whole experts over
tensor parallelism) passes the global ids as they are with `first_expert`, the global id of its
bank's expert 0: a pair whose expert is not in the bank reads no weight and its row is left
unwritten (the per-token combine adds nothing for it). Shifting and masking the ids in torch
before the kernels cost a four-GPU decode step at batch 64 about 440 small launches (9 a layer:
0.54 ms of its 7.5 ms of kernels; docs/benchmarks.md, 2026-11-28, fourth session).

All round where the unfused path rounds (gate and up, each expert's output) and add up in fp32.

A bank may be a QuantizedWeight (`ops/quantized_weight.py`: FP8 codes with per-row tile scales,
or MXFP4): every kernel here reads its codes and scales and decodes each tile in registers, an
expert's bytes read as above — the per-expert kernel to the values `bank.to(x.dtype)` gives
(`load_rows`), the per-token ones as exact fp32 products (`row_products`, on their own tiles; the
combine folds each slot's routing weight into them); the references take the chosen experts'
entries of the bank dequantized (`QuantizedWeight.experts`). `expert_pair_gemv` is the per-token
form without a fused activation (Gemma's GeGLU). GPT-OSS's experts — biases on gate, up and down
and a clamped SwiGLU — take the two fused kernels too (`bias`, `clamp`): unfused, the biases'
gathers and adds and the clamped activation were some dozen small launches a layer.

Limits: forward only (inference: no autograd); SwiGLU (plain or GPT-OSS's clamped) is the only
activation fused. The per-expert kernel sums a quantized bank's products in the dense bank's
order only because a dense bank's tile is made to take the decoded one's layout: Triton lays out
a dot operand by the narrowest load it comes from (`computeOrigBitWidth`), so a tile decoded from
bytes is held 4 elements a thread along K (kWidth 4) where a bf16 one is held 2, and mma.sync
takes other runs of K. Before, 0.01-0.03% of its outputs on an FP8 bank differed in the last bit
from its outputs on the bank dequantized (64 tokens of the Qwen3-30B-A3B shape, an H200,
2026-12-03), which parted greedy tokens at near-ties: 92.7% of 64 prompts x 64 tokens agreed
(bench/serve/decode.py --agreement 64). Now the activations of a dense bank's product pass a
`tl.where` on a mask from a byte load (AS_DECODED; always true): the walk meets a load of 8 bits,
both operands take kWidth 4, and the outputs are bit-equal — 100% of the tokens agree, 64 of 64
prompts whole (2026-12-04). It costs the bf16 bank's gate/up + down at 64 tokens 297 us against
285, ~1% of a bf16 decode step at batch 64; making the decoded tile take the dense layout instead
(a side-effecting register move, `tl.inline_asm_elementwise`) cost FP8's batch-64 step 15%.
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
from moemesh.ops.swiglu import swiglu


def _contiguous(weight):
    """A dense bank contiguous (a quantized one's codes and scales are as read: contiguous)."""
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(
            weight.format, weight.codes.contiguous(), weight.scales.contiguous(), weight.dtype, weight.offset
        )
    return weight.contiguous()


def expert_gemv(
    x: torch.Tensor, weight, expert_ids: torch.Tensor, glu: bool = False, first_expert: int = 0
) -> torch.Tensor:
    """x [T, K], weight [E, O, K] (the experts first_expert .. first_expert + E - 1), expert_ids
    [T, k] -> [T·k, O]; with `glu`, weight is [E, 2I, K] (gate rows, then up rows) and the result
    silu(gate)·up, [T·k, I]. A pair whose expert is not in the bank (another rank's) reads no
    weight: its row is left unwritten by the kernel (zeros in the reference); the caller reads none
    of them."""
    if (
        x.dim() != 2
        or weight.dim() != 3
        or expert_ids.dim() != 2
        or expert_ids.shape[0] != x.shape[0]
        or weight.shape[2] != x.shape[1]
        or (glu and weight.shape[1] % 2)
    ):
        raise ValueError(
            f"need x [T, K], weight [E, O, K] (O even with glu), expert_ids [T, k]; got "
            f"{tuple(x.shape)}, {tuple(weight.shape)}, {tuple(expert_ids.shape)}"
        )
    if use_triton(x):
        return expert_gemv_triton(x, weight, expert_ids, glu, first_expert)
    out = expert_gemv_reference(x, weight, expert_ids, first_expert)
    return swiglu(out) if glu else out


def expert_gemv_reference(x: torch.Tensor, weight, expert_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """A quantized bank: its chosen experts dequantized to x's dtype, then the same."""
    rows = x.repeat_interleave(expert_ids.shape[1], dim=0)
    ids = expert_ids.flatten() - first_expert
    outside = (ids < 0) | (ids >= weight.shape[0])  # another rank's expert: a row of zeros
    chosen = ids.clamp(0, weight.shape[0] - 1)
    matrices = weight.experts(chosen).to(x.dtype) if isinstance(weight, QuantizedWeight) else weight[chosen]
    out = torch.bmm(matrices, rows.to(matrices.dtype).unsqueeze(-1)).squeeze(-1)
    return out.masked_fill(outside[:, None], 0).to(x.dtype)


# Tiles tried at a shape's first launch (backend.tuned).
BY_EXPERT_CONFIGS = [
    triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for o, k, w, s in (
        (64, 128, 4, 3),
        (32, 256, 4, 3),
        (64, 256, 8, 3),
        (128, 128, 8, 3),
        (32, 128, 4, 4),
        (16, 256, 4, 4),
        (128, 64, 4, 3),  # wider blocks of shorter K: a TP=4 rank's slice of down [2048 x 192] read
        (128, 32, 4, 4),  # 1.17x faster in a step's graph (bench/kernels/ops.py --expert-tiles, 2026-11-29)
        (256, 128, 8, 3),  # an FP8 bank's gate/up at 64 tokens: 136.5 us against 146.7 (the same, 2026-12-04)
        (32, 128, 4, 6),  # a bf16 bank's gate/up at 32 and 64 tokens: 162.5 / 190.8 us against 165.6 / 196.8
    )
]


def expert_gemv_triton(
    x: torch.Tensor, weight, expert_ids: torch.Tensor, glu: bool = False, first_expert: int = 0
) -> torch.Tensor:
    x, weight, expert_ids = x.contiguous(), _contiguous(weight), expert_ids.contiguous()
    tokens, k = expert_ids.shape
    out_features = weight.shape[1] // 2 if glu else weight.shape[1]
    out = x.new_empty(tokens * k, out_features)
    codes, scales, stride, offset, constants = kernel_operands(weight, x.dtype)
    if tokens and k and out_features:  # a launch grid must not be empty
        _by_expert_kernel[lambda meta: (weight.shape[0], triton.cdiv(out_features, meta["BLOCK_OUT"]))](
            x,
            codes,
            scales,
            expert_ids,
            out,
            tokens * k,
            x.shape[1],
            out_features,
            triton.next_power_of_2(tokens * k),
            first_expert,
            stride,
            offset,
            PAIRS_PER_X=k,
            GLU=glu,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            AS_DECODED=constants["FORMAT"] == 0,
            **constants,
            **dependent_launch(x),
        )
    return out


@triton.jit
def count_expert_pairs(ids_ptr, pairs, expert, SCAN: tl.constexpr):
    """How many of the `pairs` ids at ids_ptr are `expert` (read SCAN at a time)."""
    count = tl.full([], 0, tl.int32)
    for s in range(0, pairs, SCAN):
        js = s + tl.arange(0, SCAN)
        count += tl.sum((tl.load(ids_ptr + js, mask=js < pairs, other=-1) == expert).to(tl.int32), axis=0)
    return count


@triton.jit
def expert_pair_block(ids_ptr, pairs, expert, first, ROWS: tl.constexpr, SCAN: tl.constexpr):
    """[ROWS] int32: the indices of the pairs of rank first .. first + ROWS - 1 among those whose
    id is `expert`, in order (0 past its last pair). A kernel a program an expert finds its rows
    with this and `count_expert_pairs` (here and in ops/invariant.py), with no sort."""
    m = tl.arange(0, ROWS)
    pair = tl.zeros([ROWS], dtype=tl.int32)
    seen = tl.full([], 0, tl.int32)
    for s in range(0, pairs, SCAN):
        js = s + tl.arange(0, SCAN)
        hit = (tl.load(ids_ptr + js, mask=js < pairs, other=-1) == expert).to(tl.int32)
        rank = seen + tl.cumsum(hit, axis=0) - 1
        pick = (hit[None, :] == 1) & (rank[None, :] == first + m[:, None])
        pair += tl.sum(tl.where(pick, js[None, :], 0), axis=1)
        seen += tl.sum(hit, axis=0)
    return pair


@tuned(BY_EXPERT_CONFIGS, key=["size_class", "inner", "out_features", "PAIRS_PER_X", "GLU", "FORMAT"])
@triton.jit
def _by_expert_kernel(
    x_ptr,
    weight_ptr,
    scales_ptr,
    ids_ptr,
    out_ptr,
    pairs,
    inner,
    out_features,
    size_class,
    first_expert,
    scale_stride,
    offset,
    PAIRS_PER_X: tl.constexpr,
    GLU: tl.constexpr,
    PRECISION: tl.constexpr,
    FORMAT: tl.constexpr,  # 0: a dense bank; 1: fp8, 2: mxfp4 (quantized_weight.load_rows)
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    GDC: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    AS_DECODED: tl.constexpr = False,
    ROWS: tl.constexpr = 16,
    SCAN: tl.constexpr = 256,
):
    wait_for_inputs(GDC)
    # One program per (expert, block of outputs). It finds the (token, slot) pairs that chose its
    # expert by scanning the ids, then streams its block of the expert's weight once per 16 of
    # them (tl.dot pads to 16 rows): an expert no pair chose costs a scan and no weight read.
    expert = tl.program_id(0)  # of the bank; its id among the step's: expert + first_expert
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    count = count_expert_pairs(ids_ptr, pairs, expert + first_expert, SCAN)
    rows_per_expert = 2 * out_features if GLU else out_features
    matrix = weight_ptr + expert.to(tl.int64) * rows_per_expert * inner + cols[None, :].to(tl.int64) * inner
    gate_rows = expert.to(tl.int64) * rows_per_expert + cols.to(tl.int64)  # a quantized bank's rows
    m = tl.arange(0, ROWS)
    if AS_DECODED:  # a dense bank's tile summed as a decoded one (the Limits above): a byte-load mask
        byte = tl.arange(0, BLOCK_K)
        nonzero = (tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + byte, mask=byte < 2 * inner, other=0) | 1) != 0
    for first in range(0, count, ROWS):
        pair = expert_pair_block(ids_ptr, pairs, expert + first_expert, first, ROWS, SCAN)
        valid = first + m < count
        x_rows = x_ptr + (pair // PAIRS_PER_X).to(tl.int64)[:, None] * inner
        acc = tl.zeros([ROWS, BLOCK_OUT], dtype=tl.float32)
        up = tl.zeros([ROWS, BLOCK_OUT], dtype=tl.float32)
        for k0 in range(0, inner, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            xs = tl.load(x_rows + ks[None, :], mask=valid[:, None] & (ks[None, :] < inner), other=0.0)
            if AS_DECODED:
                xs = tl.where(nonzero[None, :], xs, 0.0)
            if FORMAT == 0:
                w_mask = (cols[None, :] < out_features) & (ks[:, None] < inner)  # [BLOCK_K, BLOCK_OUT]
                w = tl.load(matrix + ks[:, None], mask=w_mask, other=0.0)
            else:  # the tile's codes and scales, decoded in registers
                w = tl.trans(
                    load_rows(
                        weight_ptr, scales_ptr, gate_rows, cols < out_features, k0, inner, scale_stride, offset,
                        FORMAT, ALIGNED, COMPILED, ROUND_BF16, BLOCK_K,
                    )
                ).to(x_ptr.dtype.element_ty)  # fmt: skip
            acc += tl.dot(xs, w, input_precision=PRECISION)
            if GLU:
                if FORMAT == 0:
                    w = tl.load(matrix + out_features * inner + ks[:, None], mask=w_mask, other=0.0)
                else:
                    w = tl.trans(
                        load_rows(
                            weight_ptr, scales_ptr, gate_rows + out_features, cols < out_features, k0, inner,
                            scale_stride, offset, FORMAT, ALIGNED, COMPILED, ROUND_BF16, BLOCK_K,
                        )
                    ).to(x_ptr.dtype.element_ty)  # fmt: skip
                up += tl.dot(xs, w, input_precision=PRECISION)
        if GLU:  # gate and up rounded as the unfused path's GEMV output, SwiGLU in fp32
            gate = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
            acc = gate / (1.0 + tl.exp(-gate)) * up.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(
            out_ptr + pair.to(tl.int64)[:, None] * out_features + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=valid[:, None] & (cols[None, :] < out_features),
        )


# The per-token down projection reads the ids and its first block of the chosen experts' weights
# before it waits for the gate/up kernel (`expert_gemv_combine`'s early_ids): the 48-layer
# Qwen3-30B-A3B shape's decode step at batch 1 on an H200 took 0.08 ms (2.5%) less in three pairs
# of runs, batch 8 the same (docs/benchmarks.md, 2026-11-29). False: after (for measuring).
EARLY_WEIGHTS = True
# Tiles tried at a shape's first launch (backend.tuned), for each of the two fused kernels.
SWIGLU_CONFIGS = [
    triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w)
    for o, k, w in ((16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 4), (4, 1024, 4))
]
COMBINE_CONFIGS = [
    triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w)  # [top-k, o, k] tiles
    for o, k, w in ((8, 128, 4), (4, 256, 4), (16, 64, 4), (8, 256, 8), (4, 128, 4))
]


ROW_CONFIGS = row_configs()  # a quantized bank's per-token kernels (quantized_weight.ROW_TILES)
_pair_tiles = tiles_by_format(SWIGLU_CONFIGS, ROW_CONFIGS)
_combine_tiles = tiles_by_format(COMBINE_CONFIGS, ROW_CONFIGS)


def expert_swiglu_gemv(
    x: torch.Tensor,
    gate_up,
    expert_ids: torch.Tensor,
    first_expert: int = 0,
    bias: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """x [T, K], gate_up [E, 2I, K] (gate rows, then up rows), expert_ids [T, k] -> [T·k, I]
    (Triton only: the reference is expert_gemv(x, gate_up, ids, glu=True, first_expert=...)).
    GPT-OSS's form: `bias` [E, 2I] added to gate and up (each rounded, as the unfused add rounds),
    and `clamp` (alpha, limit) its clamped SwiGLU (`ops/swiglu.clamped_swiglu`)."""
    return _per_pair(x, gate_up, expert_ids, first_expert, swiglu=True, bias=bias, clamp=clamp)


def expert_pair_gemv(
    x: torch.Tensor, weight, expert_ids: torch.Tensor, first_expert: int = 0, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [T, K], weight [E, O, K], expert_ids [T, k] -> [T·k, O], a program a (pair, block of
    outputs): the per-token form of expert_gemv(x, weight, ids, first_expert=...), for experts
    whose activation is not fused (biases, a clamped SwiGLU). Triton only."""
    return _per_pair(x, weight, expert_ids, first_expert, swiglu=False, bias=bias)


def _per_pair(
    x: torch.Tensor,
    weight,
    expert_ids: torch.Tensor,
    first_expert: int,
    swiglu: bool,
    bias: torch.Tensor | None = None,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    x, weight = x.contiguous(), _contiguous(weight)
    tokens, k = expert_ids.shape
    inner = weight.shape[1] // 2 if swiglu else weight.shape[1]
    out = x.new_empty(tokens * k, inner)
    codes, scales, stride, offset, constants = kernel_operands(weight, x.dtype)
    alpha, limit = clamp or (1.0, 0.0)
    if tokens:
        _per_pair_kernel[lambda meta: (tokens * k, triton.cdiv(inner, meta["BLOCK_OUT"]))](
            x,
            codes,
            scales,
            expert_ids.contiguous(),
            x if bias is None else bias.contiguous(),
            alpha,
            limit,
            out,
            triton.next_power_of_2(tokens),
            x.shape[1],
            inner,
            first_expert,
            weight.shape[0],
            stride,
            offset,
            K=k,
            SWIGLU=swiglu,
            HAS_BIAS=bias is not None,
            CLAMPED=clamp is not None,
            **constants,
            **dependent_launch(x),
        )
    return out


def expert_gemv_combine(
    a: torch.Tensor,
    down,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    first_expert: int = 0,
    early_ids: bool = False,
    bias: torch.Tensor | None = None,
    bias_share: float = 1.0,
) -> torch.Tensor:
    """a [T·k, I], down [E, H, I], expert_ids and weights [T, k] -> [T, H]: the slots whose expert
    is in the bank, summed (Triton only: the reference is combine_pairs(expert_gemv(a, down,
    ids.view(-1, 1), first_expert=...), ids, weights, first_expert, E)). `early_ids`: the ids were
    written before the kernel that writes `a` (the router's, before `expert_swiglu_gemv`), so each
    program reads them and its first block of the chosen experts' weights before it waits for that
    kernel under a dependent launch (ops/backend.py), as the GEMV reads its first weights.
    `bias` [E, H] (GPT-OSS's down_proj_bias): Σ_j w[t, j] · bias_share · bias[ids[t, j]] added in
    the same fp32 sum (rounded once, where the unfused path rounds the two sums apart)."""
    early_ids = early_ids and EARLY_WEIGHTS and expert_ids.is_contiguous()  # (a copy: the kernel just before)
    a, down = a.contiguous(), _contiguous(down)
    tokens, k = expert_ids.shape
    hidden = down.shape[1]
    out = a.new_empty(tokens, hidden)
    codes, scales, stride, offset, constants = kernel_operands(down, a.dtype)
    if tokens:
        _expert_gemv_combine_kernel[lambda meta: (tokens, triton.cdiv(hidden, meta["BLOCK_OUT"]))](
            a,
            codes,
            scales,
            expert_ids.contiguous(),
            weights.contiguous(),
            a if bias is None else bias.contiguous(),
            bias_share,
            out,
            triton.next_power_of_2(tokens),
            a.shape[1],
            hidden,
            first_expert,
            down.shape[0],
            stride,
            offset,
            K=k,
            K_PAD=triton.next_power_of_2(k),
            EARLY_IDS=early_ids,
            HAS_BIAS=bias is not None,
            **constants,
            **dependent_launch(a),
        )
    return out


@tuned(SWIGLU_CONFIGS + ROW_CONFIGS, key=["size_class", "hidden", "inner", "K", "SWIGLU", "FORMAT"], prune=_pair_tiles)
@triton.jit
def _per_pair_kernel(
    x_ptr,
    weight_ptr,
    scales_ptr,
    ids_ptr,
    bias_ptr,
    alpha,
    limit,
    out_ptr,
    size_class,
    hidden,
    inner,
    first_expert,
    experts,
    scale_stride,
    offset,
    K: tl.constexpr,
    SWIGLU: tl.constexpr,  # silu(gate) * up of a bank of 2 * inner rows (gate, then up); else inner rows
    HAS_BIAS: tl.constexpr,  # a bias per row of the bank, added to each product (rounded)
    CLAMPED: tl.constexpr,  # GPT-OSS's SwiGLU: clamped gate and up, sigmoid(alpha * gate), up + 1
    FORMAT: tl.constexpr,  # 0: a dense bank; 1: fp8, 2: mxfp4 (quantized_weight.row_products)
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    GDC: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    wait_for_inputs(GDC)
    row = tl.program_id(0).to(tl.int64)  # token row // K, its (row % K)-th expert
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    expert = tl.load(ids_ptr + row).to(tl.int64) - first_expert
    if (expert >= 0) & (expert < experts):  # else another rank's expert: nothing read or written
        rows_per_expert = 2 * inner if SWIGLU else inner
        gate_row = expert * rows_per_expert + cols.to(tl.int64)  # the rows of the bank flattened
        x_row = x_ptr + (row // K) * hidden
        if FORMAT == 0:
            gate_rows = weight_ptr + gate_row[:, None] * hidden
            gate = tl.zeros([BLOCK_OUT], dtype=tl.float32)
            up = tl.zeros([BLOCK_OUT], dtype=tl.float32)
            for start in range(0, hidden, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                xs = tl.load(x_row + ks, mask=ks < hidden, other=0.0).to(tl.float32)[None, :]
                mask = (cols[:, None] < inner) & (ks[None, :] < hidden)
                gate += tl.sum(tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * xs, axis=1)
                if SWIGLU:
                    up_w = tl.load(gate_rows + inner * hidden + ks[None, :], mask=mask, other=0.0).to(tl.float32)
                    up += tl.sum(up_w * xs, axis=1)
        else:  # the tiles' codes and scales decoded in registers, run sums added in a register tile
            valid = cols < inner
            gate_runs = row_products(
                weight_ptr, scales_ptr, x_row, gate_row, valid, 0, hidden, scale_stride, offset,
                FORMAT, ALIGNED, COMPILED, BLOCK_K,
            )  # fmt: skip
            if SWIGLU:
                up_runs = row_products(
                    weight_ptr, scales_ptr, x_row, gate_row + inner, valid, 0, hidden, scale_stride, offset,
                    FORMAT, ALIGNED, COMPILED, BLOCK_K,
                )  # fmt: skip
            for start in range(BLOCK_K, hidden, BLOCK_K):
                gate_runs += row_products(
                    weight_ptr, scales_ptr, x_row, gate_row, valid, start, hidden, scale_stride, offset,
                    FORMAT, ALIGNED, COMPILED, BLOCK_K,
                )  # fmt: skip
                if SWIGLU:
                    up_runs += row_products(
                        weight_ptr, scales_ptr, x_row, gate_row + inner, valid, start, hidden, scale_stride,
                        offset, FORMAT, ALIGNED, COMPILED, BLOCK_K,
                    )  # fmt: skip
            gate = tl.sum(gate_runs, axis=1)
            if SWIGLU:
                up = tl.sum(up_runs, axis=1)
        gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the unfused GEMV's output
        if HAS_BIAS:  # + the bias, rounded as the unfused add
            gate_bias = tl.load(bias_ptr + gate_row, mask=cols < inner, other=0.0).to(out_ptr.dtype.element_ty)
            gate = (gate + gate_bias.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
        if SWIGLU:
            up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
            if HAS_BIAS:
                up_bias = tl.load(bias_ptr + gate_row + inner, mask=cols < inner, other=0.0).to(
                    out_ptr.dtype.element_ty
                )
                up = (up + up_bias.to(tl.float32)).to(out_ptr.dtype.element_ty).to(tl.float32)
            if CLAMPED:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                out = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
            else:
                out = gate / (1.0 + tl.exp(-gate)) * up
        else:
            out = gate
        tl.store(out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=cols < inner)


@triton.jit
def _slot_mask(here, cols, hidden, ks, inner):
    """[K_PAD, BLOCK_OUT, BLOCK_K]: the weights of a block of K that the slots in the bank read."""
    return here[:, None, None] & (cols[None, :, None] < hidden) & (ks[None, None, :] < inner)


@triton.jit
def _slot_products(a_ptr, rows, here, ks, inner, w):
    """Each slot's activations `a` over a block of K times that block of its expert's weights `w`:
    [K_PAD, BLOCK_OUT] in fp32."""
    xs = tl.load(a_ptr + rows[:, None] * inner + ks[None, :], mask=here[:, None] & (ks[None, :] < inner), other=0.0)
    return tl.sum(w.to(tl.float32) * xs.to(tl.float32)[:, None, :], axis=2)


@tuned(COMBINE_CONFIGS + ROW_CONFIGS, key=["size_class", "inner", "hidden", "K", "FORMAT"], prune=_combine_tiles)
@triton.jit
def _expert_gemv_combine_kernel(
    a_ptr,
    weight_ptr,
    scales_ptr,
    ids_ptr,
    weights_ptr,
    bias_ptr,
    bias_share,
    out_ptr,
    size_class,
    inner,
    hidden,
    first_expert,
    experts,
    scale_stride,
    offset,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    EARLY_IDS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr,  # 0: a dense bank; 1: fp8, 2: mxfp4 (_combine_quantized)
    ALIGNED: tl.constexpr,
    COMPILED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    GDC: tl.constexpr,
    BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if FORMAT != 0:  # a quantized bank: each slot's rows in turn, products in one register tile
        wait_for_inputs(GDC)
        _combine_quantized(
            a_ptr, weight_ptr, scales_ptr, ids_ptr, weights_ptr, bias_ptr, bias_share, out_ptr, inner, hidden,
            first_expert, experts, scale_stride, offset, K, K_PAD, HAS_BIAS, FORMAT, ALIGNED, COMPILED, BLOCK_OUT,
            BLOCK_K,
        )  # fmt: skip
        return
    if not EARLY_IDS:
        wait_for_inputs(GDC)
    # The token's K experts at once, a [K, BLOCK_OUT, BLOCK_K] tile of their weights a step: more
    # bytes in flight than one expert after another.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slots = tl.arange(0, K_PAD)
    rows = token * K + slots
    chosen = tl.load(ids_ptr + rows, mask=slots < K, other=-1).to(tl.int64) - first_expert
    here = (slots < K) & (chosen >= 0) & (chosen < experts)  # a slot of another rank's expert adds nothing
    matrices = weight_ptr + chosen[:, None, None] * hidden * inner + cols[None, :, None].to(tl.int64) * inner
    ks = tl.arange(0, BLOCK_K)  # the first block of K (with early ids: read before the wait), then the rest
    w = tl.load(matrices + ks[None, None, :], mask=_slot_mask(here, cols, hidden, ks, inner), other=0.0)
    if EARLY_IDS:
        wait_for_inputs(GDC)
    acc = _slot_products(a_ptr, rows, here, ks, inner, w)
    for start in range(BLOCK_K, inner, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        w = tl.load(matrices + ks[None, None, :], mask=_slot_mask(here, cols, hidden, ks, inner), other=0.0)
        acc += _slot_products(a_ptr, rows, here, ks, inner, w)
    expert_out = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the unfused GEMV's output
    weights = tl.load(weights_ptr + rows, mask=here, other=0.0).to(tl.float32)
    total = tl.sum(weights[:, None] * expert_out, axis=0)
    if HAS_BIAS:
        total += _weighted_bias(
            bias_ptr, bias_share, ids_ptr, weights_ptr, token, cols, hidden, first_expert, experts, K, K_PAD
        )
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden)


@triton.jit
def _weighted_bias(
    bias_ptr, bias_share, ids_ptr, weights_ptr, token, cols, hidden, first_expert, experts,
    K: tl.constexpr, K_PAD: tl.constexpr,
):  # fmt: skip
    """Σ_j w[t, j] · bias_share · bias[ids[t, j]] over the token's slots in the bank: [BLOCK_OUT] fp32."""
    slots = tl.arange(0, K_PAD)
    rows = token * K + slots
    chosen = tl.load(ids_ptr + rows, mask=slots < K, other=-1).to(tl.int64) - first_expert
    here = (slots < K) & (chosen >= 0) & (chosen < experts)
    weights = tl.load(weights_ptr + rows, mask=here, other=0.0).to(tl.float32)
    bias = tl.load(
        bias_ptr + chosen[:, None] * hidden + cols[None, :], mask=here[:, None] & (cols[None, :] < hidden), other=0.0
    )
    return tl.sum(weights[:, None] * (bias.to(tl.float32) * bias_share), axis=0)


@triton.jit
def _combine_quantized(
    a_ptr, weight_ptr, scales_ptr, ids_ptr, weights_ptr, bias_ptr, bias_share, out_ptr, inner, hidden, first_expert,
    experts, scale_stride, offset, K: tl.constexpr, K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    FORMAT: tl.constexpr, ALIGNED: tl.constexpr, COMPILED: tl.constexpr, BLOCK_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The combine of a quantized bank: out[t] = Σ_j w[t, j] · down[ids[t, j]] @ a[t·k + j], each
    slot's routing weight folded into its products (each expert's output is not rounded to the
    dtype before the sum, as the dense path's is: the fp32 sum of the exact products)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    acc = tl.zeros([BLOCK_OUT, BLOCK_K // 8], dtype=tl.float32)
    for slot in tl.static_range(K):
        pair = token * K + slot
        chosen = tl.load(ids_ptr + pair).to(tl.int64) - first_expert
        rows = chosen * hidden + cols.to(tl.int64)
        valid = (cols < hidden) & (rows >= 0) & (rows < experts * hidden)  # another rank's expert adds nothing
        weight = tl.load(weights_ptr + pair).to(tl.float32)
        for start in range(0, inner, BLOCK_K):
            acc += weight * row_products(
                weight_ptr, scales_ptr, a_ptr + pair * inner, rows, valid, start, inner,
                scale_stride, offset, FORMAT, ALIGNED, COMPILED, BLOCK_K,
            )  # fmt: skip
    total = tl.sum(acc, axis=1)
    if HAS_BIAS:
        total += _weighted_bias(
            bias_ptr, bias_share, ids_ptr, weights_ptr, token, cols, hidden, first_expert, experts, K, K_PAD
        )
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden)
