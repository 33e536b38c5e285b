"""Attention against the paged KV cache (models/kv_cache.py): the new tokens of a step — one a
row when decoding, chunks of prompts beside them when prefilling — in two kernels (and a merge).

    rope_to_cache     q, k, v projections [N, heads·D] -> the per-head RMSNorm (Qwen3's q/k norm,
                      optional) and rotary embedding of q and k; k and v written into the cache
                      at each token's slot, q returned [N, heads, D]
    paged_attention   softmax(q·kᵀ·scale) v of each token over its sequence's keys 0..position
                      (or the last `window` of them), read through the sequence's block table

Eagerly these are some twenty kernels a layer (norms, the rotary's halves and concatenations,
the cache's indexed writes, the gathers through the block table, the mask, scores, softmax,
casts), each of a microsecond's work when decoding; decoding is made of such launches.

The attention kernel runs one program per (tile, key/value head, split of the keys). A tile is a
run of consecutive tokens of one sequence (one token when decoding, up to `tile_tokens` of a
prompt's chunk): its tokens × the query heads that share the key/value head are one matrix, the
keys are read once, in blocks, with a running softmax (flash attention), only up to the tile's
last position and from its window's first — entries past them are skipped — each key block
through the block table, and the causal (and window) mask applied per query. A second small
kernel merges the splits (flash-decoding: at batch 1 there would otherwise be only h_kv
programs, four for Qwen3-30B-A3B, and one such program per layer took 11 µs over 576 keys on an
H200). A split takes every SPLITS-th block of its tile's keys, so that the splits share any
length of keys without knowing it: a packed step captured in a CUDA graph replays with other
lengths (64 tokens after 1,024 cached are four tiles, 16 programs unsplit: 72 µs a layer on
an H200, 27 µs in 8 splits). A decode step splits its keys until the launch has about
SPLIT_PROGRAMS programs (16 splits at batch 1, 2 at 64, none at 256: more only adds merges); a
packed step splits only when it has fewer than 64 programs, else it runs unsplit. A packed
step's tile table has an entry per token (its tiles are found on the device, their number
unknown to the host); the programs past the step's tiles do nothing.

The reference is `models/layers.paged_attention` (the eager path: gathers through the block
table, explicit masked softmax; tests compare the two). Limits: a power-of-two head size
(16 to 256) covered whole by the rotary tables, values of the keys' size. Attention sinks
(GPT-OSS) enter where a row's sum is normalised: the last division, or the splits' merge.
Numerics: fp32 norms, rotary and softmax, rounded once to the cache's dtype; the eager path
rounds after each bf16 operation, so in bf16 the two differ by a rounding or two.
"""

import torch

from moemesh.ops.backend import dependent_launch, tl, triton, wait_for_inputs

# Keys a block of the key loop: packed steps', decode steps'.
BLOCK_KEYS, DECODE_BLOCK_KEYS = 64, 32
SPLIT_BLOCKS, MAX_SPLITS, SPLIT_PROGRAMS = 2, 16, 512  # see split_count
# A tile's query rows: its tokens × the query heads of one key/value head. The pipeline depth of
# the key loop: packed steps and decode steps. 64 rows and 2 stages took a loaded server's prefill
# round (60 decode tokens beside 4 prompts of 497) from 182 to 138 µs a layer on an H100, and one
# prompt of 512 from 40 to 34 µs (`bench/kernels/paged_attention.py --sweep`). Decode steps' 32-key blocks in
# 2 stages and their splits (split_count) took 64 tokens at ~576 cached from 53.6 to 33.5 µs a layer
# on an H200, 256 tokens from 185 to 103 µs and one token from 10.7 to 7.4 µs (blocks of 64 in 3
# stages, splits by kv_len alone; `bench/kernels/paged_attention.py --decode-sweep`).
TILE_ROWS, PACKED_STAGES, DECODE_STAGES = 64, 2, 2
# A decode step's attention reads what does not depend on the kernel before it (rope_to_cache: the
# queries and the step's keys and values) before it waits for that kernel under a dependent launch
# (ops/backend.py): the tiles, the positions, the block table and its first block of earlier
# steps' keys and values; the step's own key, if in that block, after. The 48-layer Qwen3-30B-A3B
# shape's decode step at batch 1 on an H200: 3.03 -> 2.99 ms (twice in one call), at batch 64 the
# same (docs/benchmarks.md, 2026-11-29). False: all after the wait (for measuring).
EARLY_READS = True
# rope_to_cache's tokens a program (one head of each) in steps of more than ROPE_SMALL_STEP tokens:
# a program a (token, head) made a 2,048-token prefill launch 82k programs of a few hundred bytes
# each, 67 µs a layer on an H200 (13 µs in blocks of 16). Decode steps keep a program a token, as
# they were measured and tuned.
ROPE_TOKENS, ROPE_SMALL_STEP = 16, 256


def fits(head_dim: int, rotary_dim: int) -> bool:
    """Whether these kernels take a layer of this head size and rotary width."""
    return head_dim == rotary_dim and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def tile_tokens(group: int) -> int:
    """Tokens of one sequence per tile, so that tokens × group fill about TILE_ROWS rows."""
    return max(1, TILE_ROWS // triton.next_power_of_2(group))


def rope_to_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q [N, h·D], k and v [N, h_kv·D] (rows may be strided), cos/sin [N, D], norm weights [D] or
    None, the cache's key and value pools [slots, h_kv, D], each token's slot [N] -> q [N, h, D]."""
    tokens, head_dim = cos.shape
    heads, kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    out = q.new_empty(tokens, heads, head_dim)
    if tokens:
        has_norm = q_norm is not None
        block = ROPE_TOKENS if tokens > ROPE_SMALL_STEP else 1
        _rope_to_cache_kernel[(triton.cdiv(tokens, block), heads + 2 * kv_heads)](
            q,
            k,
            v,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            cos.contiguous(),
            sin.contiguous(),
            q_norm if has_norm else cos,
            k_norm if has_norm else cos,
            eps,
            out,
            keys,
            values,
            keys.stride(0),
            keys.stride(1),
            slots,
            tokens,
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=head_dim // 2,
            HAS_NORM=has_norm,
            BLOCK_T=block,
            **dependent_launch(q),
        )
    return out


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
    tokens_per_tile: int,
    kv_len: int,
    scale: float,
    window: int | None,
    token_a_sequence: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, h, D] of tokens at `positions` [N] of the sequences in table rows `token_rows` [N]
    against the pools [slots, h_kv, D] through `block_tables` [rows, W]; the tiles (first token,
    tokens) each a run of one sequence's tokens, the first `tile_count` [1] of the table's;
    kv_len bounds the keys read (the splits) -> [N, h·D]. `token_a_sequence` (a decode step: no
    two tokens of one sequence, and the tiles made before the kernel before this one): every key
    before a token's own is an earlier step's, and each program reads its first block of them,
    and the tiles, before it waits for that kernel (see EARLY_READS). `sinks` [h] (GPT-OSS): one
    logit per query head in each softmax's denominator, with no value."""
    tokens, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = q.new_empty(tokens, heads * head_dim)
    tiles = tile_starts.shape[0]  # a packed step's table has an entry per token, the tiles first
    decoding = tokens_per_tile == 1
    programs = triton.cdiv(tokens, tokens_per_tile) * kv_heads  # (a packed step's as if one chunk)
    block_keys = DECODE_BLOCK_KEYS if decoding else BLOCK_KEYS
    splits = split_count(kv_len, programs, block_keys) if decoding or programs < 64 else 1
    partial = out if splits == 1 else q.new_empty(tokens, heads, splits, head_dim + 2, dtype=torch.float32)
    rows = max(16, triton.next_power_of_2(tokens_per_tile * group))
    if tiles:
        _paged_attention_kernel[(tiles, kv_heads, splits)](
            q.contiguous(),
            keys,
            values,
            partial,
            keys.stride(0),
            keys.stride(1),
            block_tables,
            block_tables.stride(0),
            block_size,
            token_rows,
            positions,
            tile_starts,
            tile_lengths,
            tile_count,
            scale,
            window or 0,
            q if sinks is None else sinks,
            HAS_SINKS=sinks is not None and splits == 1,
            GROUP=group,
            HEADS=heads,
            ROWS=rows,
            D=head_dim,
            BLOCK_N=block_keys,
            SPLITS=splits,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            EARLY_READS=EARLY_READS and token_a_sequence and tokens_per_tile == 1,
            num_warps=4 if rows <= 64 else 8,
            num_stages=DECODE_STAGES if decoding else PACKED_STAGES,
            **dependent_launch(q),
        )
        if splits > 1:
            _merge_splits_kernel[(tokens * heads,)](
                partial,
                out,
                q if sinks is None else sinks,
                HAS_SINKS=sinks is not None,
                HEADS=heads,
                SPLITS=splits,
                D=head_dim,
                **dependent_launch(q),
            )
    return out


def split_count(kv_len: int, programs: int, block_keys: int) -> int:
    """Programs per (tile, key/value head), of `programs` unsplit (flash-decoding's split: one row at
    batch 1 has only h_kv programs): as many as bring the launch to about SPLIT_PROGRAMS programs,
    at most one per SPLIT_BLOCKS blocks of `block_keys` of the cache read and MAX_SPLITS, a power of
    two. More programs than that only add merges: at 256 decode tokens splitting at all was slower."""
    splits = max(1, min(kv_len // (SPLIT_BLOCKS * block_keys), SPLIT_PROGRAMS // programs))
    return min(MAX_SPLITS, 1 << (splits.bit_length() - 1))


@triton.jit
def _rope_to_cache_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    q_stride,
    k_stride,
    v_stride,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    out_ptr,
    keys_ptr,
    values_ptr,
    slot_stride,
    head_stride,
    slots_ptr,
    tokens,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    GDC: tl.constexpr,
):
    """BLOCK_T tokens' one head: a query head (normed, rotated, into out), a key head (normed,
    rotated, into the cache) or a value head (into the cache)."""
    wait_for_inputs(GDC)
    token = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    valid = token < tokens
    d = tl.arange(0, HALF)
    mask = valid[:, None]
    cache_at = (tl.load(slots_ptr + token, mask=valid, other=0).to(tl.int64) * slot_stride)[:, None]
    if head >= HEADS + KV_HEADS:  # a value head: into the cache as it is
        h = head - HEADS - KV_HEADS
        src = v_ptr + token[:, None] * v_stride + h * 2 * HALF + d[None, :]
        dst = values_ptr + cache_at + h * head_stride + d[None, :]
        tl.store(dst, tl.load(src, mask=mask), mask=mask)
        tl.store(dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)
    else:
        is_query = head < HEADS
        h = tl.where(is_query, head, head - HEADS)
        if is_query:
            src = q_ptr + token[:, None] * q_stride + h * 2 * HALF + d[None, :]
        else:
            src = k_ptr + token[:, None] * k_stride + h * 2 * HALF + d[None, :]
        lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:  # transformers' RMSNorm: normalise in fp32, round, then scale by the weight
            rstd = tl.rsqrt((tl.sum(lo * lo, axis=1) + tl.sum(hi * hi, axis=1)) / (2 * HALF) + eps)[:, None]
            if is_query:
                norm_ptr = q_norm_ptr
            else:
                norm_ptr = k_norm_ptr
            lo_weight = tl.load(norm_ptr + d).to(tl.float32)[None, :]
            hi_weight = tl.load(norm_ptr + HALF + d).to(tl.float32)[None, :]
            lo = (lo * rstd).to(src.dtype.element_ty).to(tl.float32) * lo_weight
            hi = (hi * rstd).to(src.dtype.element_ty).to(tl.float32) * hi_weight
            lo = lo.to(src.dtype.element_ty).to(tl.float32)
            hi = hi.to(src.dtype.element_ty).to(tl.float32)
        table = token[:, None] * 2 * HALF + d[None, :]
        cos_lo = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
        cos_hi = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        sin_lo = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
        sin_hi = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        out_lo = lo * cos_lo - hi * sin_lo  # x·cos + rotate_half(x)·sin, rotate_half(x) = (-hi, lo)
        out_hi = hi * cos_hi + lo * sin_hi
        if is_query:
            dst = out_ptr + (token[:, None] * HEADS + h) * 2 * HALF + d[None, :]
        else:
            dst = keys_ptr + cache_at + h * head_stride + d[None, :]
        tl.store(dst, out_lo.to(dst.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, out_hi.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _key_slots(table, keys_at, present, block_size, slot_stride, head_stride, kv_head):
    """Where keys `keys_at` of a sequence (its block table at `table`) are in the pools, for one
    key/value head."""
    block = tl.load(table + keys_at // block_size, mask=present, other=0).to(tl.int64)
    return (block * block_size + keys_at % block_size) * slot_stride + kv_head * head_stride


@triton.jit
def _attend_block(q, k, v, keys_at, present, position, lowest, running_max, total, acc, scale, PRECISION: tl.constexpr):
    """One block of keys and values into the running softmax (flash attention): the new
    (maximum, total, unnormalised sum) of each query row."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = present[None, :] & (keys_at[None, :] <= position[:, None]) & (keys_at[None, :] >= lowest[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(running_max, tl.max(scores, axis=1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that sees no key yet
    alpha = tl.exp(running_max - shift)
    p = tl.exp(scores - shift[:, None])
    total = total * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return new_max, total, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    out_ptr,
    slot_stride,
    head_stride,
    tables_ptr,
    table_stride,
    block_size,
    rows_ptr,
    positions_ptr,
    tile_starts_ptr,
    tile_lengths_ptr,
    tile_count_ptr,
    scale,
    window,
    sinks_ptr,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    EARLY_READS: tl.constexpr,
    GDC: tl.constexpr,
):
    if not EARLY_READS:
        wait_for_inputs(GDC)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    tile = tl.program_id(0)
    if tile < tl.load(tile_count_ptr):  # a table entry past the step's tiles: nothing to do
        first = tl.load(tile_starts_ptr + tile).to(tl.int64)
        count = tl.load(tile_lengths_ptr + tile)
        r = tl.arange(0, ROWS)  # query row r: token r // GROUP of the tile, head r % GROUP of the group
        valid = r // GROUP < count
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        position = tl.load(positions_ptr + token, mask=valid, other=0).to(tl.int64)
        table = tables_ptr + tl.load(rows_ptr + first).to(tl.int64) * table_stride
        last = tl.max(tl.where(valid, position, -1), axis=0)
        lowest = tl.where(window > 0, position - window + 1, 0)  # each query's first visible key
        first_key = tl.maximum(tl.min(tl.where(valid, lowest, last), axis=0), 0)
        lo, hi = first_key, last + 1  # the tile's keys [lo, hi): this program takes every SPLITS-th block
        d = tl.arange(0, D)
        running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
        total = tl.zeros([ROWS], dtype=tl.float32)
        acc = tl.zeros([ROWS, D], dtype=tl.float32)
        begin = lo // BLOCK_N * BLOCK_N + split * BLOCK_N
        if EARLY_READS:  # the first block's keys of earlier steps, then the wait, then this step's
            keys_at = begin + tl.arange(0, BLOCK_N)
            present = (keys_at >= lo) & (keys_at < hi)
            slot = _key_slots(table, keys_at, present, block_size, slot_stride, head_stride, kv_head)
            earlier = present & (keys_at < last)  # (a decode step's tile is one token at `last`)
            k = tl.load(keys_ptr + slot[:, None] + d[None, :], mask=earlier[:, None], other=0.0)
            v = tl.load(values_ptr + slot[:, None] + d[None, :], mask=earlier[:, None], other=0.0)
            wait_for_inputs(GDC)
            now = (present & (keys_at >= last))[:, None]  # the key rope_to_cache just wrote, if here
            k = tl.where(now, tl.load(keys_ptr + slot[:, None] + d[None, :], mask=now, other=0.0), k)
            v = tl.where(now, tl.load(values_ptr + slot[:, None] + d[None, :], mask=now, other=0.0), v)
        at = (token * HEADS + head) * D  # q's and the output's [N, h, D]
        q = tl.load(q_ptr + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if EARLY_READS:
            if begin < hi:
                running_max, total, acc = _attend_block(
                    q, k, v, keys_at, present, position, lowest, running_max, total, acc, scale, PRECISION
                )
            begin += SPLITS * BLOCK_N
        for start in range(begin, hi, SPLITS * BLOCK_N):  # no block when no key is here
            keys_at = start + tl.arange(0, BLOCK_N)
            present = (keys_at >= lo) & (keys_at < hi)
            slot = _key_slots(table, keys_at, present, block_size, slot_stride, head_stride, kv_head)
            k = tl.load(keys_ptr + slot[:, None] + d[None, :], mask=present[:, None], other=0.0)
            v = tl.load(values_ptr + slot[:, None] + d[None, :], mask=present[:, None], other=0.0)
            running_max, total, acc = _attend_block(
                q, k, v, keys_at, present, position, lowest, running_max, total, acc, scale, PRECISION
            )
        if SPLITS == 1:
            if HAS_SINKS:  # the sink's term in the denominator, all rescaled to the larger maximum
                sink = tl.load(sinks_ptr + head, mask=valid, other=0.0).to(tl.float32)
                common = tl.maximum(running_max, sink)
                alpha = tl.exp(running_max - common)
                acc = acc * alpha[:, None]
                total = total * alpha + tl.exp(sink - common)
            out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding row has no key
            tl.store(out_ptr + at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
        else:  # [N, h, SPLITS, D + 2]: the unnormalised sum, its running maximum and total
            at = ((token * HEADS + head) * SPLITS + split) * (D + 2)
            tl.store(out_ptr + at[:, None] + d[None, :], acc, mask=valid[:, None])
            tl.store(out_ptr + at + D, running_max, mask=valid)
            tl.store(out_ptr + at + D + 1, total, mask=valid)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    out_ptr,
    sinks_ptr,
    HAS_SINKS: tl.constexpr,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    D: tl.constexpr,
    GDC: tl.constexpr,
):
    """One (token, head): the splits' sums rescaled to their common maximum (a split without keys
    has maximum -inf and weighs nothing), and with sinks the head's sink in the denominator."""
    wait_for_inputs(GDC)
    token_head = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    at = (token_head * SPLITS + splits) * (D + 2)
    maxima = tl.load(partial_ptr + at + D)
    common = tl.max(maxima, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + token_head % HEADS).to(tl.float32)
        common = tl.maximum(common, sink)
    scale = tl.exp(maxima - common)
    total = tl.sum(tl.load(partial_ptr + at + D + 1) * scale, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - common)
    acc = tl.sum(tl.load(partial_ptr + at[:, None] + d[None, :]) * scale[:, None], axis=0)
    tl.store(out_ptr + token_head * D + d, (acc / total).to(out_ptr.dtype.element_ty))
