"""Batch-invariant arithmetic (issue 50): while `batch_invariant()` is on, every row a model
computes — a token's projections, its attention, its experts, its logits — gets the same bits
whatever else is computed with it. The engine's tokens and log-probabilities then do not depend
on the step's other sequences, on where chunked prefill split a prompt, on prefix reuse or on
preemption; and the trainer's forward of a whole sequence gives each token's log-probability
bit-equal to the engine's, which sampled it one step at a time (reinforcement learning's
importance ratio is then exactly 1 where the weights are the same).

Why the default path is not: a GEMM's kernel, and with it the order in which a row's products
are added, depends on how many rows it computes (cuBLAS picks its tiles and split-K by shape; on
a CPU torch's fp32 `F.linear` of 1 to 8 rows differs from the same rows among 64); decoding
attends over a padded window with a mask, split over the keys by the batch's size, and prefill
over a whole chunk; the MoE takes a per-token path for few tokens and grouped GEMMs for many.

Two implementations of the three ops, chosen per call by the tensor's device (`kernels`: CUDA,
or MOEMESH_KERNELS=triton under Triton's interpreter):

  * `linear` — CPU reference: rows in tiles of TILE (the last padded), one GEMM call a tile, so
    each row is computed by a call of the same shape wherever it sits. GPU: `matmul`, a Triton
    kernel: BLOCK_M rows × BLOCK_N columns a program, K in blocks of BLOCK_K added in order from 0
    into an fp32 accumulator, no split-K — so a row's products are summed in the order its own
    row and column fix, whatever else is in its tile (a tensor-core MMA computes an output element
    from its row and column only; rows past the end load zeros). The tiles themselves follow the
    row count (`_tiles`: small for a decode step, larger for training's thousands of rows) — in
    bf16 that changes no bit, which is measured, not proven: on an H200 every one of 38 configs
    gave every weight of the Qwen3-30B-A3B shape the same bits at 1, 64 and 8,192 rows
    (`bench/kernels/ops.py --invariant-tiles`; the GPU tests below compare 1 row with 130). fp32 (the
    CPU tests' interpreter, whose tl.dot is numpy's) keeps one config whatever the rows. The
    programs take TILE_GROUP M tiles at a time across every N tile (`_tile_of`: a group's rows and
    weight tiles come from L2 after their first read; the experts' gate_up at 8,192 rows 1.23×
    faster than M tile first, the same bits).
    Backward is the ordinary one (autograd.Function): only forward values must agree.
  * `attend` — CPU reference: one query at a time over exactly its keys, in fp32. GPU:
    `paged_attention`, one kernel for the engine's steps (decode tokens, prompt chunks, against
    the paged cache) and for the trainer's whole sequences (`causal_attention`: each row's keys
    as one block of T). A program takes a tile of one sequence's consecutive tokens × the query
    heads of one key/value head (ATTENTION_ROWS rows in the engine's steps, WHOLE_SEQUENCE_ROWS
    for the trainer's bf16 sequences) and reads the keys 0..the tile's last position in blocks of
    ATTENTION_KEYS starting at key 0, with a running softmax in fp32 — no split of the keys. A
    query's numbers depend only on the blocks it sees, which are the same whatever its tile: a
    block it sees none of (its tile's later tokens') leaves its maximum, sum and accumulator
    exactly as they were. Keys are read through the block table one by one, so the cache's block
    size does not matter either; strides that are multiples of 16 are told to the kernel, which
    then reads a key's row in 16-byte loads (1.44× faster, the same bits); the blocks a tile sees
    whole skip the causal mask (the same bits: the kernel is compiled without fused
    multiply-adds, so a product rounds alike in both). Backward (training): the kernel also
    writes each query's log-sum-exp, and torch's cuDNN (or flash) attention backward takes it
    with the kernel's output (`causal_attention`, `attention_gradient`). At 4 × 2,048 tokens on
    an H200 the forward is 1.9× cuDNN's (518 µs; 5.2× before the aligned loads, the larger tiles
    and the unmasked blocks) and forward and backward 1.23× SDPA's (docs/benchmarks.md,
    2026-11-28, fifth session).
  * `experts` — CPU reference: each expert's rows through its two `linear`s. GPU:
    `grouped_matmul`, the same matmul kernel over tiles of BLOCK_M rows of one expert (each
    program finds its tile from the group sizes, `_expert_tile`: no host sync, no table), for
    gate_up and then down, the activation between (elementwise), each row bit-equal to `matmul`
    of it alone with its expert's weight. The block's own dispatch (a copy of each row, in any
    layout) and combine (the k outputs summed with the routing weights in slot order) as the
    default path.
    A decode step's few pairs skip the dispatch (models/moe.py: up to SELECTED_EXPERT_ROWS
    pairs, no gradients, every expert on the rank, no adapters): `selected_experts` computes
    them in (token, slot) order by `_selected_matmul_kernel`, a program an (expert, N tile) that
    finds its expert's pairs by scanning the ids (ops/expert_gemv.py's `expert_pair_block`, as the
    default path's kernel does) and takes
    them in the grouped launch's blocks, in the same order, with its BLOCK_M and BLOCK_K (columns,
    warps and stages of its own for a decode step's few rows: `_selected_tiles`); each block through
    the K loop `_matmul_kernel` runs (`_row_block_product`, one function for both), so a pair's
    row is the grouped path's by construction, and `combine` at the identity positions sums the
    same rows in the same order. Why: with the dispatch (routing_layout's sort, searchsorted and
    scatter, the row copy, a tile table's ~15 torch ops, the zero fills) the mode's decode step
    ran about 40 small kernels a MoE layer more than the default path — 3,243 kernels a step
    against 891, 1.33× its time, at batch 64 of the Qwen3-30B-A3B shape on an H200 (1.20×
    without it; the engine and the trainer still agree on every bit, measured). Limits:
    forward only; ids must lie in [0, E) (a pair of another id is never written); every
    program scans all the step's ids once, and again per block of its pairs, so it is for few
    pairs (past SELECTED_EXPERT_ROWS, and for training, the mode dispatches). Both paths need
    an activation that gives an element the same bits wherever it sits in the tensor, as the
    Triton kernels and CUDA's elementwise ops do; torch's CPU loops do not quite (a tensor's
    last elements go through the scalar function, whose exp can differ in the last bit).

Every other op of the models (norms, rotary, softmax and top-k of the router, sampling, the
log-softmax of log-probabilities) is already per row, on a CPU and in the Triton kernels on a GPU
(rms_norm's tile depends on the width alone; topk_softmax is a program a token) — torch's CUDA
softmax and log_softmax pick their kernel by the row's width, not the number of rows.

Exactness is tested on CPUs (tests/test_batch_invariant.py): the reference in fp32 and bf16, the
kernels under Triton's interpreter in fp32 (its bf16 tl.dot is wrong), the tiny model's engine and
trainer through them included. On a GPU in bf16 the claim is measured, not proven by a test here:
`bench/serve/decode.py --layers 48 --batch-invariant` (bench/README.md) counts what differs over
10k tokens of the 48-layer Qwen3-30B-A3B shape. Limits: decode at batch 1 has only a
program per key/value head in attention (no split: a split would have to be fixed per key
position, and the trainer would have to take it too); the matmul stays 1.1-1.3× cuBLAS's time at
training's row counts (docs/benchmarks.md; reading its blocks by TMA was measured and did not
pay). Not covered: attention sinks and sliding windows, latent attention, LoRA adapters (merge
them first), packed documents in a training row. Under tensor parallelism, and expert parallelism
for decoding, the engine and the trainer agree bit for bit on two ranks (a sum of two partials
has one order); over more ranks the all-reduces' order may depend on their size.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as F

from moemesh.ops.backend import tl, triton, use_triton
from moemesh.ops.expert_gemv import count_expert_pairs, expert_pair_block
from moemesh.ops.grouped_mm import group_offsets, product, weight_gradient

TILE = 16  # rows a GEMM call of the CPU reference computes, whatever the batch
# The matmul kernel's programs take this many M tiles at a time across every N tile (`_tile_of`).
TILE_GROUP = 8
_on = False

# The fp32 kernels' tiles (the CPU tests' interpreter, whose tl.dot is numpy's and whose sums
# follow its shape): one config whatever the rows. bf16 and fp16 on a GPU pick theirs by the row
# count (`_tiles`).
BLOCK_M, BLOCK_K = 64, 32
# Attention: the query rows of a program (its tokens × the query heads of one key/value head) and
# the keys of a block of the key loop (blocks start at key 0, 64, 128, ... for every query).
ATTENTION_ROWS, ATTENTION_KEYS = 64, 64
# The trainer's whole sequences (`causal_attention`) in bf16 and fp16: tiles of this many query
# rows. A query's bits do not change with them — measured, not proven: on an H200, at the
# Qwen3-30B-A3B shape's heads (4 × 2,048 tokens), tiles of 64, 128 and 256 rows gave every query
# the same bits, and 256 rows in 16 warps took 460 µs where 64 took 794 (in 8 warps 528); 32 rows,
# or a decode step's 16 in 2 warps (MMAs of other shapes), did change bits (bench/kernels/ops.py
# --invariant-attention; docs/benchmarks.md, 2026-11-28, fourth, fifth and seventh sessions). That
# many rows for heads of up to 128 dims, fewer for wider ones (the accumulator, rows × dims in
# fp32, stays that of 256 × 128). fp32 (the CPU tests' interpreter, whose tl.dot is numpy's)
# keeps the engine's tile.
WHOLE_SEQUENCE_ROWS = 256
# The key blocks every query of a tile sees whole go through the kernel without the causal mask
# (the same bits). False: every block masked, as before, for measuring the difference.
UNMASKED_WHOLE_BLOCKS = True


def _jit(*varying: str):
    """triton.jit with the integer arguments `varying` (those that change with the batch or with
    who calls: a row count, the cache's block size, a table's width) neither specialised on the
    value 1 nor on their alignment, so that every call of a kernel runs one compiled program."""
    return triton.jit(do_not_specialize=varying, do_not_specialize_on_alignment=varying)


def on() -> bool:
    return _on


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Compute in batch-invariant mode inside (process-wide, not thread-safe); `enabled=False`
    leaves the mode as it is."""
    global _on
    before, _on = _on, _on or enabled
    try:
        yield
    finally:
        _on = before


def whole_rows(positions: torch.Tensor) -> bool:
    """Whether positions [B, T] are 0..T-1 in every row (one sequence a row; a wait for the device:
    the model's forward asks once, not each layer)."""
    return bool((positions == torch.arange(positions.shape[-1], device=positions.device)).all())


def kernels(x: torch.Tensor) -> bool:
    """Whether the mode computes `x`'s ops with the Triton kernels below (CUDA tensors; CPU ones
    under Triton's interpreter with MOEMESH_KERNELS=triton) rather than the CPU reference."""
    return use_triton(x)


# ---- linear -------------------------------------------------------------------------------------
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias): on the kernels' device by `matmul`, else each row computed in a
    tile of TILE rows (the CPU reference)."""
    if kernels(x):
        out = _Matmul.apply(x, weight)
        return out if bias is None else out + bias.to(out.dtype)
    rows = x.reshape(-1, x.shape[-1])
    padded = F.pad(rows, (0, 0, 0, (-rows.shape[0]) % TILE))
    out = torch.cat([F.linear(tile, weight.to(x.dtype)) for tile in padded.split(TILE)])[: rows.shape[0]]
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (the weight cast to it), fp32 sums: one
    program a (BLOCK_M rows, BLOCK_N columns) tile, K added in blocks of BLOCK_K in order."""
    rows, width = x.shape
    out = x.new_empty(rows, weight.shape[0])
    if rows and weight.shape[0]:
        _launch_matmul(x, weight, out, None, rows, _tiles(rows, weight.shape[0], x.dtype))
    return out


def _tiles(rows: int, n: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a launch over `rows` rows (a grouped launch:
    its mean rows an expert) of a weight `n` wide. fp32: one config (see BLOCK_M). bf16 and fp16:
    narrow tiles for a decode step's few rows, 128 × 256 for training's many — the fastest of the
    configs below on an H200 (`bench/kernels/ops.py --invariant-tiles`), which all give the same bits:
    there 38 configs (BLOCK_M 16-128, BLOCK_N 32-256, BLOCK_K 64 or 128, 4 warps up to 64 × 64
    tiles and 8 above, 3 or 4 stages) computed every weight of the Qwen3-30B-A3B shape at 1, 64
    and 8,192 rows to the same bits: the tensor cores add a row's products k-block by k-block in
    one order whatever the tile."""
    if dtype == torch.float32:
        return BLOCK_M, 32 if n <= 4096 else 64 if n < 65536 else 128, BLOCK_K, 4, 3
    if rows > 64:  # 128 × 256 for the wide weights (3 stages: 144 KB of shared memory)
        # BLOCK_M follows the rows alone: the two banks' grouped launches cut the same tiles, and a
        # BLOCK_M past a group's rows computes masked rows for nothing.
        return (128, 256, 64, 8, 3) if n >= 512 else (128, 128, 64, 8, 3)
    block_m, block_n = 16 if rows <= 16 else 64, 32 if n <= 2048 else 64 if n <= 4096 else 128
    return block_m, block_n, 128, 4 if block_m * block_n <= 64 * 64 else 8, 4


def _launch_matmul(x, weight, out, group_sizes, rows: int, config, tile_group: int = TILE_GROUP) -> None:
    """One launch of `_matmul_kernel` with `config` (`_tiles`): plain (group_sizes None) or grouped
    (weight [E, N, K], x's rows sorted by expert in groups of group_sizes [E] from row 0: the
    kernel cuts each group in M tiles of BLOCK_M from its first row, `_expert_tile`). The
    programs run `tile_group` M tiles at a time across every N tile (TILE_GROUP; one group of all
    the M tiles is the order before, M tile fastest, which bench/kernels/ops.py compares)."""
    n, k = weight.shape[-2:]
    block_m, block_n = config[:2]
    grouped = group_sizes is not None
    experts = weight.shape[0] if grouped else 1
    # Grouped: at most cdiv(rows, BLOCK_M) tiles, plus one a group for its last, partial one, plus
    # one for the partial tile of the rows past the groups (zeroed by the kernel).
    m_tiles = triton.cdiv(rows, block_m) + (experts + 1 if grouped else 0)
    n_tiles = triton.cdiv(n, block_n)
    w_strides = weight.stride() if grouped else (0, *weight.stride())
    _matmul_kernel[(m_tiles * n_tiles,)](
        x,
        weight,
        out,
        group_sizes if grouped else x,
        experts,
        rows,
        m_tiles,
        n_tiles,
        min(tile_group, m_tiles),
        n,
        k,
        x.stride(0),
        x.stride(1),
        *w_strides,
        out.stride(0),
        GROUPED=grouped,
        EXPERTS=triton.next_power_of_2(experts),
        **_launch_meta(x.dtype, config),
    )


def _launch_meta(dtype: torch.dtype, config) -> dict:
    """The meta-parameters of a launch of `_matmul_kernel` or `_selected_matmul_kernel` with
    `config` (`_tiles`): the same for both, so that a row's arithmetic is too."""
    block_m, block_n, block_k, warps, stages = config
    return dict(
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )


class _Matmul(torch.autograd.Function):
    """`matmul` of x [..., K] forward (its rows flattened here, not by autograd views: a training
    step of a few thousand tokens is bound by its host); the ordinary backward (only forward
    values need to agree)."""

    @staticmethod
    def forward(ctx, x, weight):
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.shape = x.shape
        return matmul(rows, weight).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        rows, weight = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x = (grad @ weight.to(grad.dtype)).view(ctx.shape) if ctx.needs_input_grad[0] else None
        grad_w = (grad.T @ rows).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


# The row count is not specialised (a step of one row runs the program of many); the strides are,
# on their alignment as triton does by default: vectorised loads, several times faster at 64 rows
# and more, the same bits (measured with the tiles, `_tiles`).
@_jit("rows", "m_tiles", "n_tiles", "tile_group")
def _matmul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sizes_ptr,
    experts,
    rows,
    m_tiles,
    n_tiles,
    tile_group,
    n,
    k,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    GROUPED: tl.constexpr,
    EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[rows] = x[rows] @ w[expert].T for one (M tile, N tile). A row's products are summed in
    the same order wherever the row sits: K in blocks of BLOCK_K from 0, each block one tl.dot
    into the fp32 accumulator (rows past the tile's end load zeros and are not stored). Program p
    takes M tile and N tile by `_tile_of` (the order of the programs changes no bits: each
    computes its tile alone)."""
    tile, column = _tile_of(tl.program_id(0), m_tiles, n_tiles, tile_group)
    if GROUPED:
        expert, first, end = _expert_tile(sizes_ptr, experts, tile, EXPERTS, BLOCK_M)
    else:
        expert = 0
        first = tile * BLOCK_M
        end = rows
    if first < end:  # a grouped launch's tiles past the step's: nothing to do
        r = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        c = column * BLOCK_N + tl.arange(0, BLOCK_N)
        in_rows, in_cols = r < end, c < n
        acc = _row_block_product(
            x_ptr,
            r,
            in_rows,
            w_ptr + expert * stride_we,
            c,
            in_cols,
            k,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
        )
        out = out_ptr + r[:, None] * stride_om + c[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])
    if GROUPED:  # a tile past the groups' tiles zeroes its share of the rows past the groups
        first, end = _rows_past_the_groups(sizes_ptr, experts, rows, tile, EXPERTS, BLOCK_M)
        if first < end:
            r = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
            c = column * BLOCK_N + tl.arange(0, BLOCK_N)
            zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + r[:, None] * stride_om + c[None, :], zeros, mask=(r < end)[:, None] & (c < n)[None, :])


@triton.jit
def _tile_of(program, m_tiles, n_tiles, tile_group):
    """(M tile, N tile) of program `program`: the programs take `tile_group` M tiles (the last
    group fewer) across every N tile, M tile fastest, then the next group's — so that a group's
    rows of x and its weight's N tiles are read from memory about once and then from L2, where
    M tile fastest over all of them read a large x again for every N tile (Triton's matmul
    tutorial's grouped order)."""
    per_group = tile_group * n_tiles
    first = program // per_group * tile_group
    size = tl.minimum(m_tiles - first, tile_group)
    within = program % per_group
    return first + within % size, within // size


@triton.jit
def _rows_past_the_groups(sizes_ptr, experts, rows, tile, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """(first, end) of the rows past the groups that tile `tile` of a grouped launch zeroes: the
    tiles after the groups' take them BLOCK_M at a time (an empty range for the groups' tiles).
    The output is not filled with zeros first: a fill of the whole output was 2 launches a MoE
    layer, 3.4 ms of a 4 × 2,048-token training step of the 24-layer Qwen3-30B-A3B shape."""
    e = tl.arange(0, EXPERTS)
    sizes = tl.load(sizes_ptr + e, mask=e < experts, other=0).to(tl.int64)
    group_tiles = tl.sum((sizes + BLOCK_M - 1) // BLOCK_M, axis=0)
    first = tl.sum(sizes, axis=0) + (tile - group_tiles) * BLOCK_M
    past = tile >= group_tiles
    return tl.where(past, first, 0), tl.where(past, tl.minimum(first + BLOCK_M, rows), 0)


@triton.jit
def _expert_tile(sizes_ptr, experts, tile, EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr):
    """(expert, first row, end row) of M tile `tile` of a grouped launch, whose rows are sorted by
    expert in groups of the sizes at sizes_ptr ([experts], EXPERTS its next power of two): each
    group cut in tiles of BLOCK_M from its first row, the groups' tiles in expert order; a tile
    past the last, (0, 0, 0). Each program finds its own from the sizes (a few vector ops on E
    numbers), where a table made by torch ops cost ~20 small launches a MoE layer."""
    e = tl.arange(0, EXPERTS)
    sizes = tl.load(sizes_ptr + e, mask=e < experts, other=0).to(tl.int64)
    tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)  # tiles of earlier experts end at or before it
    mine = e == expert
    group_end = tl.sum(tl.where(mine, tl.cumsum(sizes, axis=0), 0), axis=0)
    group_first = group_end - tl.sum(tl.where(mine, sizes, 0), axis=0)
    first = group_first + (tile - tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)) * BLOCK_M
    used = expert < experts
    end = tl.minimum(first + BLOCK_M, group_end)
    return tl.where(used, expert, 0).to(tl.int64), tl.where(used, first, 0), tl.where(used, end, 0)


@triton.jit
def _row_block_product(
    x_ptr,
    r,
    in_rows,
    w_base,
    c,
    in_cols,
    k,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """x[r] @ w[c].T -> [BLOCK_M, BLOCK_N] fp32, for the rows r (int64 [BLOCK_M]) of x and the
    columns c [BLOCK_N] of the weight at w_base; rows and columns out of in_rows / in_cols load
    zeros. K in blocks of BLOCK_K from 0, each block one tl.dot into the fp32 accumulator (acc
    passed in, not added after: another rounding). The one K loop of `_matmul_kernel` and
    `_selected_matmul_kernel`, so that a row's arithmetic is the same in both."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, k, BLOCK_K):
        kk = start + tl.arange(0, BLOCK_K)
        in_k = kk < k
        a = tl.load(
            x_ptr + r[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=in_rows[:, None] & in_k[None, :],
            other=0.0,
        )
        b = tl.load(
            w_base + c[None, :] * stride_wn + kk[:, None] * stride_wk,
            mask=in_cols[None, :] & in_k[:, None],
            other=0.0,
        )
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    return acc


# ---- attention ----------------------------------------------------------------------------------
def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query's attention (the CPU reference): q [h, D] over its keys k [h_kv, n, D] and values
    v [h_kv, n, Dv] (the h / h_kv query heads of a group share a key/value head) -> [h, Dv] in
    q's dtype."""
    groups = q.shape[0] // k.shape[0]
    keys, values = k.float().repeat_interleave(groups, 0), v.float().repeat_interleave(groups, 0)
    scores = (q.float()[:, None, :] * keys).sum(-1) * scale  # [h, n]
    probs = torch.softmax(scores, dim=-1)
    return (probs[..., None] * values).sum(1).to(q.dtype)


def tile_tokens(group: int) -> int:
    """Tokens of one sequence a program of `paged_attention` takes (× `group` query heads each)."""
    return max(1, ATTENTION_ROWS // triton.next_power_of_2(group))


def whole_sequence_tokens(group: int, head_dim: int) -> int:
    """Tokens a program of the trainer's bf16 whole sequences takes (`WHOLE_SEQUENCE_ROWS`, fewer
    rows for heads wider than 128), at least the engine's `tile_tokens`."""
    rows = min(WHOLE_SEQUENCE_ROWS, WHOLE_SEQUENCE_ROWS * 128 // max(16, triton.next_power_of_2(head_dim)))
    return max(tile_tokens(group), rows // triton.next_power_of_2(group))


def paged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    tile_starts: torch.Tensor,
    tile_lengths: torch.Tensor,
    tile_count: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of q [N, h, D] (tokens at `positions` [N] of the sequences in table rows
    `token_rows` [N]) over the key and value pools [slots, h_kv, D] read through `block_tables`;
    tiles: runs of at most `tile_tokens(h / h_kv)` tokens of one sequence (first token, tokens),
    the first `tile_count` [1] of them -> [N, h, D] in q's dtype.

    Every query attends over its keys 0..position in blocks of ATTENTION_KEYS from key 0, in
    order, with a running softmax in fp32; a block the query sees none of (a later token's of its
    tile) changes none of its numbers (its maximum stays, it adds exact zeros). So a query's bits
    do not depend on its tile's other tokens, on the cache's block size, or on the step."""
    args = (block_tables, block_size, token_rows, positions, tile_starts, tile_lengths, tile_count, scale)
    return _launch_attention(q, keys, values, *args, tile_tokens(q.shape[1] // keys.shape[1]))


def _launch_attention(
    q, keys, values, block_tables, block_size, token_rows, positions, tile_starts, tile_lengths, tile_count, scale,
    tokens_a_tile: int, warps: int | None = None, stages: int = 2, aligned: bool | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`paged_attention`'s launch for tiles of `tokens_a_tile` tokens (× the group's query heads:
    the program's rows), with `warps` (by default by the tile's size) and `stages`
    (bench/kernels/ops.py --invariant-attention tries others than the shipped ones). `aligned`: the
    pools' strides told to the kernel as multiples of 16 (by default where they are), so that it
    reads a key's row in 16-byte loads. `lse` [B, h, T] fp32, where the tokens are B whole
    sequences of T: each query's log-sum-exp written there too.

    No fused multiply-adds the compiler chooses (`enable_fp_fusion=False`): a product rounds where
    the source says — its one `tl.fma` included — so that the blocks a tile sees whole, whose
    causal mask the kernel skips, compute the bits of the same blocks masked (a fusion found in one
    path and not in the other would round once where the other rounds twice)."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = q.new_empty(tokens, heads, head_dim)
    tiles = tile_starts.shape[0]
    if tiles and tokens:
        rows = max(16, triton.next_power_of_2(tokens_a_tile * group))
        block_d = max(16, triton.next_power_of_2(head_dim))
        if warps is None:  # 16 for the trainer's tiles: 1.24x faster than 8 at 256 rows, the same bits
            warps = 4 if rows * block_d <= 64 * 128 else 8 if rows * block_d <= 128 * 128 else 16
        if aligned is None:
            aligned = all(stride % 16 == 0 for stride in (*keys.stride()[:2], *values.stride()[:2]))
        _attention_kernel[(tiles, kv_heads)](
            q.contiguous(),
            keys,
            values,
            out,
            out if lse is None else lse,
            keys.stride(0),
            keys.stride(1),
            values.stride(0),
            values.stride(1),
            block_tables,
            block_tables.stride(0),
            block_size,
            token_rows,
            positions,
            tile_starts,
            tile_lengths,
            tile_count,
            1 if lse is None else lse.shape[-1],
            scale * math.log2(math.e),  # the kernel's softmax is in base 2
            GROUP=group,
            HEADS=heads,
            ROWS=rows,
            D=head_dim,
            BLOCK_D=block_d,
            BLOCK_N=ATTENTION_KEYS,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            ALIGNED=aligned,
            STORE_LSE=lse is not None,
            UNMASKED=UNMASKED_WHOLE_BLOCKS,
            num_warps=warps,
            num_stages=stages,
            enable_fp_fusion=False,
        )
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, T, h, D], k and v [B, T, h_kv, D], each row a sequence from position 0 -> [B, T, h, D]:
    `paged_attention` with each row's keys as one block of T. Differentiable: the kernel also
    writes each query's log-sum-exp, and the backward is torch's fused one (cuDNN's on an H200),
    fed the kernel's own output and log-sum-exp (`_CausalAttention`, `attention_gradient`): no
    second forward for the gradient. Before, torch's attention ran beside the kernel for its
    backward alone: forward and backward 1.48× SDPA's at 4 × 2,048 tokens on an H200, now
    1.14–1.17× (docs/benchmarks.md, 2026-11-28, fifth and seventh sessions)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _CausalAttention.apply(q, k, v, scale)
    return _whole_sequence_attention(q, k, v, scale)[0]


def _whole_sequence_attention(q, k, v, scale: float, lse: bool = False) -> tuple:
    """`causal_attention`'s forward -> (out [B, T, h, D], lse [B, h, T] fp32 or None)."""
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    per_tile = tile_tokens(group) if q.dtype == torch.float32 else whole_sequence_tokens(group, head_dim)
    sums = torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device) if lse else None
    out = _launch_attention(
        q.reshape(batch * seq, heads, head_dim),
        k.reshape(batch * seq, *k.shape[2:]),
        v.reshape(batch * seq, *v.shape[2:]),
        *_whole_sequences(batch, seq, per_tile, q.device),
        scale,
        per_tile,
        lse=sums,
    )
    return out.view(batch, seq, heads, head_dim), sums


class _CausalAttention(torch.autograd.Function):
    """The kernel's forward; the gradient from its output and log-sum-exp (`attention_gradient`)."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        out, lse = _whole_sequence_attention(q, k, v, scale, lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        return (*attention_gradient(grad, *ctx.saved_tensors, ctx.scale), None)


def attention_gradient(grad, q, k, v, out, lse, scale: float) -> tuple:
    """(dq, dk, dv) of causal attention out [B, T, h, D] = softmax(q kᵀ · scale) v over keys
    [B, T, h_kv, D], from `out` and each query's log-sum-exp lse [B, h, T] (fp32): torch's cuDNN
    attention backward where it runs, else flash attention's (`_fused_gradient`), else the same
    formulas in fp32 with the [B, h, T, T] probabilities materialised — meant for the CPU tests'
    sizes; fp32 on a GPU takes this path too, a few GB at 4 × 2,048 tokens of 32 heads:

        P = exp(q kᵀ · scale - lse),  dv = Pᵀ dO,  dS = P ∘ (dO vᵀ - rowsum(dO ∘ out)),
        dq = dS k · scale,  dk = dSᵀ q · scale    (a group's query heads summed into its k and v)."""
    backend = _fused_backward(q)
    if backend is not None:
        return _fused_gradient(backend, grad, q, k, v, out, lse, scale)
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    qf, do, of = (t.float().transpose(1, 2) for t in (q, grad, out))  # [B, h, T, D]
    kf, vf = (t.float().transpose(1, 2).repeat_interleave(group, 1) for t in (k, v))
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = torch.where(causal, torch.exp(qf @ kf.transpose(-1, -2) * scale - lse[..., None]), 0.0)
    dv = probs.transpose(-1, -2) @ do
    ds = probs * (do @ vf.transpose(-1, -2) - (do * of).sum(-1, keepdim=True))
    dq, dk = ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale

    def per_kv_head(t):  # [B, h, T, D] -> [B, T, h_kv, D], a group's heads summed
        return t.unflatten(1, (-1, group)).sum(2).transpose(1, 2)

    return dq.transpose(1, 2).to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _fused_backward(q: torch.Tensor) -> str | None:
    """Which of torch's fused attention backward kernels takes q [B, T, h, D] and its k, v: "cudnn"
    (on an H200 at 4 × 2,048 tokens 861 µs where flash's took 1,427: docs/benchmarks.md),
    "flash", or None (the CPU, fp32, other head sizes)."""
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0):
        return None
    capability = torch.cuda.get_device_capability(q.device)
    if capability >= (9, 0) and q.shape[-1] <= 128 and torch.backends.cudnn.is_available():
        return "cudnn"
    if capability >= (8, 0) and q.shape[-1] <= 256 and torch.backends.cuda.is_flash_attention_available():
        return "flash"
    return None


def _fused_gradient(backend: str, grad, q, k, v, out, lse, scale: float) -> tuple:
    """`attention_gradient` by torch's `backend` kernel ("cudnn" or "flash"), fed our output and
    log-sum-exp in place of its own forward's (both take the natural log-sum-exp of the scaled
    scores, [B, h, T]); tensors as the kernels take them, [B, h, T, D] views."""
    seq = q.shape[1]
    grad, q, k, v, out = (t.transpose(1, 2) for t in (grad, q, k, v, out))
    empty = torch.empty(0, dtype=torch.int64, device=q.device)  # no dropout: its random state unused
    if backend == "cudnn":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse.unsqueeze(-1), empty, empty, None, None, None, seq, seq, 0.0, True, scale=scale
        )
    else:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, seq, seq, 0.0, True, empty, empty, scale=scale
        )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


@functools.lru_cache(maxsize=16)
def _whole_sequences(batch: int, seq: int, per_tile: int, device: torch.device) -> tuple:
    """`paged_attention`'s arguments from block_tables to tile_count for `batch` rows of `seq`
    tokens, each row a sequence whose keys are one block: made once per shape and read by every
    layer (a forward's 48 layers made them each with a dozen small ops and a host copy, which
    the training step's host, its bottleneck at a few thousand tokens, paid 48 times)."""
    sequences = torch.arange(batch, device=device, dtype=torch.int32)
    firsts = torch.arange(0, seq, per_tile, device=device, dtype=torch.int32)
    starts = (sequences[:, None] * seq + firsts[None, :]).flatten()
    lengths = (seq - firsts).clamp(max=per_tile).repeat(batch)
    return (
        sequences[:, None].contiguous(),
        max(seq, 1),
        sequences.repeat_interleave(seq),
        torch.arange(seq, device=device, dtype=torch.int32).repeat(batch),
        starts,
        lengths,
        torch.full((1,), starts.shape[0], device=device, dtype=torch.int32),
    )


@_jit(
    "key_slot_stride",
    "key_head_stride",
    "value_slot_stride",
    "value_head_stride",
    "table_stride",
    "block_size",
    "lse_tokens",
)
def _attention_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    out_ptr,
    lse_ptr,
    key_slot_stride,
    key_head_stride,
    value_slot_stride,
    value_head_stride,
    tables_ptr,
    table_stride,
    block_size,
    rows_ptr,
    positions_ptr,
    tile_starts_ptr,
    tile_lengths_ptr,
    tile_count_ptr,
    lse_tokens,
    scale,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    ALIGNED: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UNMASKED: tl.constexpr,
):
    """One (tile, key/value head): the tile's tokens × the group's query heads as ROWS query rows
    against the keys 0..the tile's last position. The key blocks every row of the tile sees whole
    come first, without the causal mask (`tl.where` of an all-true mask is the identity: the same
    bits), then the blocks it sees in part. STORE_LSE: each row's log-sum-exp of its scaled
    scores into lse [B, h, lse_tokens] (flash attention's layout, for its backward) where the
    tokens are B whole sequences of lse_tokens."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    if tile < tl.load(tile_count_ptr):
        first = tl.load(tile_starts_ptr + tile).to(tl.int64)
        count = tl.load(tile_lengths_ptr + tile)
        r = tl.arange(0, ROWS)  # query row r: token r // GROUP of the tile, head r % GROUP of the group
        valid = r // GROUP < count
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        position = tl.load(positions_ptr + token, mask=valid, other=-1).to(tl.int64)
        table = tables_ptr + tl.load(rows_ptr + first).to(tl.int64) * table_stride
        hi = tl.max(position, axis=0) + 1  # the tile's keys [0, hi)
        seen_by_all = 0
        if UNMASKED:
            seen_by_all = (tl.min(tl.where(valid, position, hi), axis=0) + 1) // BLOCK_N * BLOCK_N
        d = tl.arange(0, BLOCK_D)
        in_d = d < D
        at = (token * HEADS + head) * D  # q's and the output's [N, h, D]
        q = tl.load(q_ptr + at[:, None] + d[None, :], mask=valid[:, None] & in_d[None, :], other=0.0)
        running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        total = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        for start in range(0, seen_by_all, BLOCK_N):
            running_max, total, acc = _attention_block(
                q, keys_ptr, values_ptr, table, block_size, kv_head, key_slot_stride, key_head_stride,
                value_slot_stride, value_head_stride, start, hi, position, running_max, total, acc, scale,
                d, in_d, BLOCK_N, PRECISION, ALIGNED, D == BLOCK_D, False,
            )  # fmt: skip
        for start in range(seen_by_all, hi, BLOCK_N):
            running_max, total, acc = _attention_block(
                q, keys_ptr, values_ptr, table, block_size, kv_head, key_slot_stride, key_head_stride,
                value_slot_stride, value_head_stride, start, hi, position, running_max, total, acc, scale,
                d, in_d, BLOCK_N, PRECISION, ALIGNED, D == BLOCK_D, True,
            )  # fmt: skip
        total = tl.where(total > 0, total, 1.0)  # a row past the tile's tokens
        out = acc / total[:, None]
        tl.store(
            out_ptr + at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & in_d[None, :]
        )
        if STORE_LSE:
            sequence = token // lse_tokens
            lse_at = (sequence * HEADS + head) * lse_tokens + token - sequence * lse_tokens
            tl.store(lse_ptr + lse_at, (running_max + tl.log2(total)) * 0.6931471805599453, mask=valid)  # ln 2


@triton.jit
def _attention_block(
    q, keys_ptr, values_ptr, table, block_size, kv_head, key_slot_stride, key_head_stride, value_slot_stride,
    value_head_stride, start, hi, position, running_max, total, acc, scale, d, in_d,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, ALIGNED: tl.constexpr, EVEN_D: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """The keys [start, start + BLOCK_N) into a tile's running softmax -> (maximum, sum,
    accumulator). MASKED: the block may hold keys past some row's position or past the tile's
    keys (else every row sees all of them); EVEN_D: the head's dims fill BLOCK_D."""
    keys_at = start + tl.arange(0, BLOCK_N)
    present = keys_at < hi
    block = tl.load(table + keys_at // block_size, mask=present, other=0).to(tl.int64)
    slot = block * block_size + keys_at % block_size
    key_rows = slot * key_slot_stride + kv_head * key_head_stride
    value_rows = slot * value_slot_stride + kv_head * value_head_stride
    if ALIGNED:
        key_rows, value_rows = tl.multiple_of(key_rows, 16), tl.multiple_of(value_rows, 16)
    keys_at_d, values_at_d = keys_ptr + key_rows[:, None] + d[None, :], values_ptr + value_rows[:, None] + d[None, :]
    if MASKED:
        k = tl.load(keys_at_d, mask=present[:, None] & in_d[None, :], other=0.0)
    elif EVEN_D:
        k = tl.load(keys_at_d)
    else:
        k = tl.load(keys_at_d, mask=in_d[None, :], other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # unscaled
    if MASKED:
        scores = tl.where(present[None, :] & (keys_at[None, :] <= position[:, None]), scores, float("-inf"))
    # In base 2, scale = the softmax's × log2(e): the maximum scaled once a row (rounding is
    # monotonic: the same as the maximum of the scaled scores), each score scaled and shifted in one
    # fused multiply-add, one exp2 (tl.exp would multiply by log2(e) again).
    new_max = tl.maximum(running_max, tl.max(scores, axis=1) * scale)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that sees no key yet
    alpha = tl.exp2(running_max - shift)
    p = tl.exp2(tl.fma(scores, scale, -shift[:, None]))
    total = total * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(values_at_d, mask=present[:, None] & in_d[None, :], other=0.0)
    elif EVEN_D:
        v = tl.load(values_at_d)
    else:
        v = tl.load(values_at_d, mask=in_d[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return new_max, total, acc


# ---- experts ------------------------------------------------------------------------------------
def experts(
    grouped: torch.Tensor,
    group_sizes: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of a dispatch, grouped [N, H] sorted by expert in groups of group_sizes [E] (banks
    gate_up [E, 2I, H], down [E, H, I]), each through its expert's two projections -> [N, H]; rows
    past the last group (served elsewhere) are zeros. On the kernels' device each projection is
    one `grouped_matmul` launch; else a loop over the experts' `linear`s. Differentiable."""
    if kernels(grouped):
        experts_of = (
            row_experts(group_sizes, grouped.shape[0]) if gate_up_bias is not None or down_bias is not None else None
        )
        h = _GroupedMatmul.apply(grouped, gate_up, group_sizes)
        if gate_up_bias is not None:
            h = h + _per_row(gate_up_bias, experts_of).to(h.dtype)
        out = _GroupedMatmul.apply(activation(h), down, group_sizes)
        if down_bias is not None:
            out = out + _per_row(down_bias, experts_of).to(out.dtype)
        return out
    pieces, start = [], 0
    for expert, size in enumerate(group_sizes.tolist()):
        rows = grouped[start : start + size]
        h = linear(rows, gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert])
        pieces.append(linear(activation(h), down[expert], None if down_bias is None else down_bias[expert]))
        start += size
    return torch.cat([*pieces, grouped.new_zeros(grouped.shape[0] - start, grouped.shape[1])])


def _per_row(bias: torch.Tensor, row_experts: torch.Tensor) -> torch.Tensor:
    """bias [E, n] of each row's expert (zeros past the last group: their expert is E)."""
    return F.pad(bias, (0, 0, 0, 1))[row_experts]


def row_experts(group_sizes: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert [rows] (E past the last group)."""
    ends = group_sizes.long().cumsum(0)
    return torch.searchsorted(ends, torch.arange(rows, device=group_sizes.device), right=True)


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """out[rows of expert e] = x[rows] @ weight[e].T for weight [E, N, K] and x's rows sorted by
    expert in groups of group_sizes [E] (on x's device); rows past the last group are 0. Each
    row's bits as `matmul`'s kernel computes a row, whatever the other rows of its expert."""
    out = x.new_empty(x.shape[0], weight.shape[1])  # every row written by the kernel, zeros past the groups
    if x.shape[0] and weight.shape[1]:
        config = _tiles(x.shape[0] // weight.shape[0], weight.shape[1], x.dtype)
        _launch_matmul(x, weight, out, group_sizes, x.shape[0], config)
    return out


class _GroupedMatmul(torch.autograd.Function):
    """`grouped_matmul` forward; backward (only forward values must agree) as the default path's:
    torch's grouped GEMM where it runs (`grouped_mm.product`, `weight_gradient`), else a loop
    over the experts."""

    @staticmethod
    def forward(ctx, x, weight, group_sizes):
        ctx.save_for_backward(x, weight, group_sizes)
        return grouped_matmul(x, weight, group_sizes)

    @staticmethod
    def backward(ctx, grad):
        x, weight, group_sizes = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_w = None
        offsets = group_offsets(x, group_sizes)
        if ctx.needs_input_grad[0]:  # the rows past the groups feed nothing: their gradient is never read
            grad_x = product(grad, weight.to(grad.dtype).transpose(-2, -1), group_sizes, offsets)
        if ctx.needs_input_grad[1]:
            grad_w = weight_gradient(grad, x, group_sizes, offsets).to(weight.dtype)
        return grad_x, grad_w, None


# ---- a decode step's experts --------------------------------------------------------------------
def selected_experts(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] through each token's experts expert_ids [T, k] (ids in [0, E), as top-k gives
    them) -> [T·k, H] in (token, slot) order: row t·k + j is down[e] @ activation(gate_up[e] @
    x[t]) for e = expert_ids[t, j], plus the experts' biases [E, 2I] and [E, H] where given — each
    row bit-equal to that pair's row of `experts` over `permute`'s dispatch of the same routing.

    On the kernels' device: two launches of `_selected_matmul_kernel` (gate_up from the token rows
    pair // k, down from the pair rows) with `activation` (elementwise) and the biases between, in
    the ops and dtypes of `experts`; no sort, tile table, row copy or fill. Forward only (a
    decode step: no autograd through the kernel), on the kernels' device only (`kernels`: the
    CPU reference dispatches, models/moe.py)."""
    k = expert_ids.shape[1]
    if not kernels(x):
        raise ValueError("invariant.selected_experts runs on the kernels' device; the CPU reference dispatches")
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, gate_up, down, gate_up_bias, down_bias)
    ):
        raise ValueError("invariant.selected_experts computes no gradients: call it under torch.no_grad()")
    ids = expert_ids.contiguous()
    h = _selected_matmul(x, gate_up, ids, k)
    if gate_up_bias is not None:  # as `experts` adds it: the bias of each row's expert, in h's dtype
        h = h + gate_up_bias[ids.flatten()].to(h.dtype)
    out = _selected_matmul(activation(h), down, ids, 1)
    if down_bias is not None:
        out = out + down_bias[ids.flatten()].to(out.dtype)
    return out


def _selected_matmul(x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, per_x: int) -> torch.Tensor:
    """out[pair] = x[pair // per_x] @ weight[ids[pair]].T for the pairs of ids (flattened, T·k of
    them; weight [E, N, K]) -> [T·k, N], with the grouped launch's BLOCK_M and BLOCK_K for these
    pairs (`_tiles` for T·k rows of E experts) and, for a decode step's few rows an expert, tiles
    of its own (`_selected_tiles`)."""
    pairs = ids.numel()
    experts_count, n, k = weight.shape
    out = x.new_empty(pairs, n)
    if pairs and n:
        config = _selected_tiles(_tiles(pairs // experts_count, n, x.dtype), k)
        _selected_matmul_kernel[(experts_count, triton.cdiv(n, config[1]))](
            x,
            weight,
            ids,
            out,
            pairs,
            n,
            k,
            x.stride(0),
            x.stride(1),
            *weight.stride(),
            out.stride(0),
            PAIRS_PER_X=per_x,
            **_launch_meta(x.dtype, config),
        )
    return out


def _selected_tiles(grouped: tuple[int, int, int, int, int], k: int) -> tuple[int, int, int, int, int]:
    """The selected kernel's config from the grouped launch's (`_tiles`): at up to 16 rows an
    expert in bf16 or fp16, the same BLOCK_M and BLOCK_K with 64 or 128 columns a program (128
    where K is 2,048 or more), 4 warps and 3 stages. At 64 tokens of the Qwen3-30B-A3B shape on an
    H200 (`bench/kernels/ops.py --selected-tiles`): gate_up 207 -> 196 µs, down 139 -> 110 (95% and
    85% of the copy rate), and every config of that sweep gave the grouped config's bits."""
    block_m, _, block_k, _, _ = grouped
    if block_m != 16 or block_k != 128:  # fp32's one config; the wider tiles of more rows
        return grouped
    return block_m, 128 if k >= 2048 else 64, block_k, 4, 3


# The pair count is not specialised (a step of one pair runs the program of many), as
# `_matmul_kernel`'s rows are not.
@_jit("pairs")
def _selected_matmul_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    pairs,
    n,
    k,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    PAIRS_PER_X: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SCAN: tl.constexpr = 256,
):
    """out[pair] = x[pair // PAIRS_PER_X] @ w[expert].T for the pairs that chose this program's
    expert, one N tile. It counts them by scanning the ids, then takes them BLOCK_M at a time in
    (token, slot) order, those past the last pair masked — exactly the rows, in the same places,
    of the grouped launch's tiles of this expert (its
    rows are the same pairs sorted stably by expert); each block through `_row_block_product`,
    stored at out[pair]. An expert no pair chose costs a scan."""
    expert = tl.program_id(0)
    count = count_expert_pairs(ids_ptr, pairs, expert, SCAN)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = c < n
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    m = tl.arange(0, BLOCK_M)
    for first in range(0, count, BLOCK_M):
        pair = expert_pair_block(ids_ptr, pairs, expert, first, BLOCK_M, SCAN)
        in_rows = first + m < count
        acc = _row_block_product(
            x_ptr,
            (pair // PAIRS_PER_X).to(tl.int64),
            in_rows,
            w_base,
            c,
            in_cols,
            k,
            stride_xm,
            stride_xk,
            stride_wn,
            stride_wk,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            PRECISION,
        )
        out = out_ptr + pair.to(tl.int64)[:, None] * stride_om + c[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])
