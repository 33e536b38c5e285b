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
an H200, 27 µs in 8 splits). Steps with tiles enough (about 64 tiles × key/value heads) run
unsplit. A packed step's tile table has an entry per token (its tiles are found on the device,
their number unknown to the host); the programs past the step's tiles do nothing.

Lone tiles. In a packed step the decode tokens beside the prompts are tiles of one token each
(a token's query heads: 8 of the tile's 64 rows), and unsplit each walks its whole context, one
key block after another: in a loaded server's round (60 decode tokens at ~640 cached beside 3
prompts of 512) they took the attention from ~77 to 173 µs a layer on an H200. So a packed step
may name its lone tiles — one token, at least LONE_FROM keys, at most one a sequence
(`lone_tiles`, found on the device) — which the main launch skips and a second launch runs as a
decode step's: 16-row tiles, the keys split, the splits' sums kept by lone tile (not by token: a
buffer the size of the step's sequences, not of its tokens) and merged into their tokens' rows.

The reference is `models/layers.paged_attention` (the eager path: gathers through the block
table, explicit masked softmax; tests compare the two). Limits: a power-of-two head size
(16 to 256) covered whole by the rotary tables, no attention sinks, values of the keys' size.
Numerics: fp32 norms, rotary and softmax, rounded once to the cache's dtype; the eager path
rounds after each bf16 operation, so in bf16 the two differ by a rounding or two.
"""

import torch

from moemesh.ops.backend import tl, triton

BLOCK_KEYS = 64
SPLIT_KEYS, MAX_SPLITS = 128, 16  # see split_count
# Tiles × key/value heads below which a packed step splits every tile's keys (few programs).
FEW_TILE_PROGRAMS = 64
# A packed step's one-token tiles with at least this many keys run split, as lone tiles.
LONE_FROM = 2 * BLOCK_KEYS
# A tile's query rows: its tokens × the query heads of one key/value head. The pipeline depth of
# the key loop: packed steps and decode steps (Triton's default). 64 rows and 2 stages took a loaded
# server's prefill round (60 decode tokens beside 4 prompts of 497) from 182 to 138 µs a layer on an
# H100, and one prompt of 512 from 40 to 34 µs; `bench/paged_attention.py --sweep` measured them.
TILE_ROWS, PACKED_STAGES, DECODE_STAGES = 64, 2, 3
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
    lone: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """q [N, h, D] of tokens at `positions` [N] of the sequences in table rows `token_rows` [N]
    against the pools [slots, h_kv, D] through `block_tables` [rows, W]; the tiles (first token,
    tokens) each a run of one sequence's tokens, the first `tile_count` [1] of the table's;
    kv_len bounds the keys read (the splits); `lone`: a packed step's `lone_tiles` -> [N, h·D]."""
    tokens, heads, head_dim = q.shape
    out = q.new_empty(tokens, heads * head_dim)
    if not tile_starts.shape[0]:
        return out
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    few_tiles = triton.cdiv(tokens, tokens_per_tile) * kv_heads < FEW_TILE_PROGRAMS  # (as if one chunk)
    splits = split_count(kv_len) if tokens_per_tile == 1 or few_tiles else 1
    lone_splits = split_count(kv_len) if lone is not None and splits == 1 else 1
    lone_tokens, lone_count = tile_count, tile_count  # (not read without lone tiles)
    partial = out  # the splits' fp32 sums [rows, h, splits, D + 2] where keys are split (else not read)
    if splits > 1:
        partial = q.new_empty(tokens, heads, splits, head_dim + 2, dtype=torch.float32)
    elif lone_splits > 1:  # the main programs skip the lone tiles (their lengths 0)
        tile_lengths, lone_tokens, lone_count = lone
        partial = q.new_empty(len(lone_tokens), heads, lone_splits, head_dim + 2, dtype=torch.float32)
    lone_programs = len(lone_tokens) * lone_splits if lone_splits > 1 else 0
    tiles = tile_starts.shape[0]  # a packed step's table has an entry per token, the tiles first
    rows = max(16, triton.next_power_of_2(tokens_per_tile * group))
    _paged_attention_kernel[(tiles + lone_programs, kv_heads, splits)](
        q.contiguous(),
        keys,
        values,
        out,
        partial,
        keys.stride(0),
        keys.stride(1),
        block_tables,
        block_tables.stride(0),
        block_size,
        token_rows,
        positions,
        tiles,
        tile_starts,
        tile_lengths,
        tile_count,
        lone_tokens,
        lone_count,
        scale,
        window or 0,
        GROUP=group,
        HEADS=heads,
        ROWS=rows,
        D=head_dim,
        BLOCK_N=BLOCK_KEYS,
        SPLITS=splits,
        LONE_SPLITS=lone_splits if lone_programs else 0,
        LONE_ROWS=max(16, triton.next_power_of_2(group)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if rows <= 64 else 8,
        num_stages=DECODE_STAGES if tokens_per_tile == 1 else PACKED_STAGES,
    )
    if splits > 1 or lone_programs:  # each token's splits, or each lone tile's into its token's row
        merged, targets, count = (
            (tokens, tile_starts, tile_count) if splits > 1 else (len(lone_tokens), lone_tokens, lone_count)
        )
        _merge_splits_kernel[(merged * heads,)](
            partial, out, targets, count, HEADS=heads, SPLITS=max(splits, lone_splits), D=head_dim, BY_TILE=splits == 1
        )
    return out


def lone_tiles(
    tile_starts: torch.Tensor, tile_lengths: torch.Tensor, tile_count: torch.Tensor, positions: torch.Tensor, bound: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed step's lone tiles (see the module doc), on the device without a host sync: the
    tiles' lengths with the lone ones 0 (the main launch skips them), the lone tiles' tokens
    [bound] and their number [1]. A tile is lone when it is one token with >= LONE_FROM keys and
    among the first `bound` such (a sequence has one at most: bound = the table's rows)."""
    real = torch.arange(tile_starts.shape[0], device=tile_starts.device) < tile_count
    lone = real & (tile_lengths == 1) & (positions[tile_starts.long()] + 1 >= LONE_FROM)
    lone &= lone.cumsum(0) <= bound
    at = torch.where(lone, lone.cumsum(0) - 1, bound)  # the rest into a spare entry, cut off
    tokens = tile_starts.new_zeros(bound + 1).scatter_(0, at, tile_starts)[:bound]
    return torch.where(lone, 0, tile_lengths), tokens, lone.sum(dtype=tile_count.dtype).view(1)


def split_count(kv_len: int) -> int:
    """Programs per (tile, key/value head): one per SPLIT_KEYS entries of the cache read, a power of
    two, at most MAX_SPLITS (flash-decoding's split; one row at batch 1 has only h_kv programs)."""
    return min(MAX_SPLITS, 1 << max(0, (kv_len // SPLIT_KEYS).bit_length() - 1))


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
):
    """BLOCK_T tokens' one head: a query head (normed, rotated, into out), a key head (normed,
    rotated, into the cache) or a value head (into the cache)."""
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
def _paged_attention_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    out_ptr,
    partial_ptr,
    slot_stride,
    head_stride,
    tables_ptr,
    table_stride,
    block_size,
    rows_ptr,
    positions_ptr,
    tiles,
    tile_starts_ptr,
    tile_lengths_ptr,
    tile_count_ptr,
    lone_tokens_ptr,
    lone_count_ptr,
    scale,
    window,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    LONE_SPLITS: tl.constexpr,
    LONE_ROWS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Programs [0, tiles) of axis 0 take the tile table's entries, split SPLITS ways on axis 2;
    with LONE_SPLITS, the programs after them take the lone tiles, LONE_SPLITS programs each."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    table = (tables_ptr, table_stride, block_size, rows_ptr, positions_ptr, scale, window)
    pools = (keys_ptr, values_ptr, slot_stride, head_stride)
    main = True
    if LONE_SPLITS > 0:
        main = tile < tiles
        if tile >= tiles:
            slot = ((tile - tiles) // LONE_SPLITS).to(tl.int64)
            if slot < tl.load(lone_count_ptr):
                first = tl.load(lone_tokens_ptr + slot).to(tl.int64)
                split = ((tile - tiles) % LONE_SPLITS).to(tl.int64)
                _attend_tile(
                    q_ptr,
                    partial_ptr,
                    pools,
                    table,
                    first,
                    1,
                    slot,
                    kv_head,
                    split,
                    GROUP,
                    HEADS,
                    LONE_ROWS,
                    D,
                    BLOCK_N,
                    LONE_SPLITS,
                    PRECISION,
                )
    if main:
        if tile < tl.load(tile_count_ptr):  # a table entry past the step's tiles: nothing to do
            first = tl.load(tile_starts_ptr + tile).to(tl.int64)
            count = tl.load(tile_lengths_ptr + tile)
            split = tl.program_id(2).to(tl.int64)
            _attend_tile(
                q_ptr,
                out_ptr if SPLITS == 1 else partial_ptr,
                pools,
                table,
                first,
                count,
                first,
                kv_head,
                split,
                GROUP,
                HEADS,
                ROWS,
                D,
                BLOCK_N,
                SPLITS,
                PRECISION,
            )


@triton.jit
def _attend_tile(
    q_ptr,
    out_ptr,
    pools,
    table,
    first,
    count,
    partial_first,
    kv_head,
    split,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One tile's `count` tokens from token `first` against one key/value head's keys, this
    program's every SPLITS-th block of them: the output rows (SPLITS 1) or the split's partial
    sums at rows partial_first + the token's index in the tile."""
    keys_ptr, values_ptr, slot_stride, head_stride = pools
    tables_ptr, table_stride, block_size, rows_ptr, positions_ptr, scale, window = table
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
    at = (token * HEADS + head) * D  # q's and the output's [N, h, D]
    q = tl.load(q_ptr + at[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    running_max = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    begin = lo // BLOCK_N * BLOCK_N + split * BLOCK_N
    for start in range(begin, hi, SPLITS * BLOCK_N):  # no block when no key is here
        keys_at = start + tl.arange(0, BLOCK_N)
        present = (keys_at >= lo) & (keys_at < hi)
        block = tl.load(table + keys_at // block_size, mask=present, other=0).to(tl.int64)
        slot = (block * block_size + keys_at % block_size) * slot_stride + kv_head * head_stride
        k = tl.load(keys_ptr + slot[:, None] + d[None, :], mask=present[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = present[None, :] & (keys_at[None, :] <= position[:, None]) & (keys_at[None, :] >= lowest[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row that sees no key yet
        alpha = tl.exp(running_max - shift)
        p = tl.exp(scores - shift[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(values_ptr + slot[:, None] + d[None, :], mask=present[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    if SPLITS == 1:
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a padding row has no key
        tl.store(out_ptr + at[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:  # [rows, h, SPLITS, D + 2]: the unnormalised sum, its running maximum and total
        at = (((partial_first + r // GROUP) * HEADS + head) * SPLITS + split) * (D + 2)
        tl.store(out_ptr + at[:, None] + d[None, :], acc, mask=valid[:, None])
        tl.store(out_ptr + at + D, running_max, mask=valid)
        tl.store(out_ptr + at + D + 1, total, mask=valid)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    out_ptr,
    targets_ptr,
    count_ptr,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    D: tl.constexpr,
    BY_TILE: tl.constexpr,
):
    """One (token, head), or (`BY_TILE`) one (tile, head) into its token's row, for the first
    `count` tiles: the splits' sums rescaled to their common maximum (a split without keys has
    maximum -inf and weighs nothing)."""
    entry = tl.program_id(0).to(tl.int64)
    row = entry // HEADS
    if BY_TILE:
        go = row < tl.load(count_ptr)
        target = tl.load(targets_ptr + row, mask=go, other=0).to(tl.int64) * HEADS + entry % HEADS
    else:
        go, target = True, entry
    if go:
        splits = tl.arange(0, SPLITS)
        d = tl.arange(0, D)
        at = (entry * SPLITS + splits) * (D + 2)
        maxima = tl.load(partial_ptr + at + D)
        scale = tl.exp(maxima - tl.max(maxima, axis=0))
        total = tl.sum(tl.load(partial_ptr + at + D + 1) * scale, axis=0)
        acc = tl.sum(tl.load(partial_ptr + at[:, None] + d[None, :]) * scale[:, None], axis=0)
        tl.store(out_ptr + target * D + d, (acc / total).to(out_ptr.dtype.element_ty))
