"""Attention for decoding: one new token per row against the static KV cache, in two kernels
(and a merge).

    rope_to_cache     q, k, v projections [B, heads·D] -> the per-head RMSNorm (Qwen3's q/k norm,
                      optional) and rotary embedding of q and k; k and v written into the cache
                      at each row's position, q returned [B, heads, D]
    cached_attention  softmax(q·kᵀ·scale) v over each row's keys 0..position (or the last
                      `window` of them), the query heads that share a key/value head together

Eagerly these are some twenty kernels a layer (norms, the rotary's halves and concatenations,
the cache's indexed writes, the mask, scores, softmax, casts), each of a microsecond's work;
decoding is made of such launches. The attention kernel runs one program per (row, key/value
head, split of the keys): its query heads are one matrix, the keys are read once, in blocks,
with a running softmax, and only up to the row's own position — the entries past it, which the
eager path reads and masks, are skipped; a second small kernel merges the splits
(flash-decoding: at batch 1 there would otherwise be only h_kv programs, four for Qwen3-30B-A3B,
and one such program per layer took 11 µs over 576 keys on an H200).

The reference is `models/layers.Attention`'s eager path (tests compare the two); these kernels
serve it when one token per row meets a cache on a Triton device. Limits: a power-of-two head
size (16 to 256) covered whole by the rotary tables, no attention sinks, rows whose last dimension
is contiguous. Numerics: fp32 norms, rotary and softmax, rounded once to the cache's dtype; the
eager path rounds after each bf16 operation, so in bf16 the two differ by a rounding or two.
"""

import torch

from moemesh.ops.backend import tl, triton

BLOCK_KEYS = 64
SPLIT_KEYS, MAX_SPLITS = 128, 16  # see split_count


def fits(head_dim: int, rotary_dim: int) -> bool:
    """Whether these kernels take a layer of this head size and rotary width."""
    return head_dim == rotary_dim and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


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
    row_start: int,
    positions: torch.Tensor,
) -> torch.Tensor:
    """q [B, h·D], k and v [B, h_kv·D] (rows may be strided), cos/sin [B, D], norm weights [D] or
    None, the cache's keys/values [rows, h_kv, max_len, D], positions [B] (may be strided)
    -> q [B, h, D]."""
    batch, head_dim = cos.shape
    heads, kv_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    out = q.new_empty(batch, heads, head_dim)
    if batch:
        has_norm = q_norm is not None
        _rope_to_cache_kernel[(batch, heads + 2 * kv_heads)](
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
            keys.stride(2),
            row_start,
            positions,
            positions.stride(0),
            HEADS=heads,
            KV_HEADS=kv_heads,
            HALF=head_dim // 2,
            HAS_NORM=has_norm,
        )
    return out


def cached_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    row_start: int,
    positions: torch.Tensor,
    kv_len: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """q [B, h, D] against the cache's keys/values [rows, h_kv, max_len, D] of rows row_start..,
    each row's keys up to its position (< kv_len) -> [B, h·D] in q's dtype."""
    batch, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    out = q.new_empty(batch, heads * head_dim)
    splits = split_count(kv_len)
    chunk = triton.cdiv(triton.cdiv(kv_len, splits), BLOCK_KEYS) * BLOCK_KEYS
    partial = out if splits == 1 else q.new_empty(batch, heads, splits, head_dim + 2, dtype=torch.float32)
    if batch:
        _cached_attention_kernel[(batch, kv_heads, splits)](
            q.contiguous(),
            keys,
            values,
            partial,
            keys.stride(0),
            keys.stride(1),
            keys.stride(2),
            row_start,
            positions,
            positions.stride(0),
            chunk,
            scale,
            window or 0,
            GROUP=group,
            GROUP_PAD=max(16, triton.next_power_of_2(group)),
            D=head_dim,
            BLOCK_N=BLOCK_KEYS,
            SPLITS=splits,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        if splits > 1:
            _merge_splits_kernel[(batch * heads,)](partial, out, SPLITS=splits, D=head_dim)
    return out


def split_count(kv_len: int) -> int:
    """Programs per (row, key/value head): one per SPLIT_KEYS entries of the cache read, a power of
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
    row_stride,
    head_stride,
    pos_stride,
    row_start,
    positions_ptr,
    positions_step,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, HALF)
    position = tl.load(positions_ptr + row * positions_step).to(tl.int64)
    cache_at = (row_start + row) * row_stride + position * pos_stride
    if head >= HEADS + KV_HEADS:  # a value head: into the cache as it is
        h = head - HEADS - KV_HEADS
        src = v_ptr + row * v_stride + h * 2 * HALF
        dst = values_ptr + cache_at + h * head_stride
        tl.store(dst + d, tl.load(src + d))
        tl.store(dst + HALF + d, tl.load(src + HALF + d))
    else:
        is_query = head < HEADS
        h = tl.where(is_query, head, head - HEADS)
        if is_query:
            src = q_ptr + row * q_stride + h * 2 * HALF
        else:
            src = k_ptr + row * k_stride + h * 2 * HALF
        lo = tl.load(src + d).to(tl.float32)
        hi = tl.load(src + HALF + d).to(tl.float32)
        if HAS_NORM:  # transformers' RMSNorm: normalise in fp32, round, then scale by the weight
            rstd = tl.rsqrt((tl.sum(lo * lo, axis=0) + tl.sum(hi * hi, axis=0)) / (2 * HALF) + eps)
            if is_query:
                norm_ptr = q_norm_ptr
            else:
                norm_ptr = k_norm_ptr
            lo = (lo * rstd).to(src.dtype.element_ty).to(tl.float32) * tl.load(norm_ptr + d).to(tl.float32)
            hi = (hi * rstd).to(src.dtype.element_ty).to(tl.float32) * tl.load(norm_ptr + HALF + d).to(tl.float32)
            lo = lo.to(src.dtype.element_ty).to(tl.float32)
            hi = hi.to(src.dtype.element_ty).to(tl.float32)
        table = row * 2 * HALF
        cos_lo, cos_hi = tl.load(cos_ptr + table + d).to(tl.float32), tl.load(cos_ptr + table + HALF + d).to(tl.float32)
        sin_lo, sin_hi = tl.load(sin_ptr + table + d).to(tl.float32), tl.load(sin_ptr + table + HALF + d).to(tl.float32)
        out_lo = lo * cos_lo - hi * sin_lo  # x·cos + rotate_half(x)·sin, rotate_half(x) = (-hi, lo)
        out_hi = hi * cos_hi + lo * sin_hi
        if is_query:
            dst = out_ptr + (row * HEADS + h) * 2 * HALF
        else:
            dst = keys_ptr + cache_at + h * head_stride
        tl.store(dst + d, out_lo.to(dst.dtype.element_ty))
        tl.store(dst + HALF + d, out_hi.to(dst.dtype.element_ty))


@triton.jit
def _cached_attention_kernel(
    q_ptr,
    keys_ptr,
    values_ptr,
    out_ptr,
    row_stride,
    head_stride,
    pos_stride,
    row_start,
    positions_ptr,
    positions_step,
    chunk,
    scale,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    position = tl.load(positions_ptr + row * positions_step).to(tl.int64)
    first = tl.where(window > 0, tl.maximum(position - window + 1, 0), 0)  # the window's first key
    lo = tl.maximum(first, split * chunk)  # this program's keys: [lo, hi)
    hi = tl.minimum(position + 1, (split + 1) * chunk)
    heads = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    head = kv_head * GROUP + heads  # the query heads of this key/value head
    q = tl.load(
        q_ptr + ((row * tl.num_programs(1) * GROUP + head) * D)[:, None] + d[None, :],
        mask=(heads < GROUP)[:, None],
        other=0.0,
    )
    cache = keys_ptr + (row_start + row) * row_stride + kv_head * head_stride
    vcache = values_ptr + (row_start + row) * row_stride + kv_head * head_stride
    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
    begin = lo // BLOCK_N * BLOCK_N
    for start in range(begin, tl.where(hi > lo, hi, begin), BLOCK_N):  # no block when no key is here
        keys_at = start + tl.arange(0, BLOCK_N)
        visible = (keys_at >= lo) & (keys_at < hi)
        k = tl.load(cache + keys_at[:, None] * pos_stride + d[None, :], mask=visible[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        alpha = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(vcache + keys_at[:, None] * pos_stride + d[None, :], mask=visible[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max
    mine = (heads < GROUP)[:, None]
    if SPLITS == 1:
        out = acc / total[:, None]
        tl.store(
            out_ptr + ((row * tl.num_programs(1) * GROUP + head) * D)[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mine,
        )
    else:  # [B, h, SPLITS, D + 2]: the unnormalised sum, its running maximum and total
        at = ((row * tl.num_programs(1) * GROUP + head) * SPLITS + split) * (D + 2)
        tl.store(out_ptr + at[:, None] + d[None, :], acc, mask=mine)
        tl.store(out_ptr + at + D, running_max, mask=heads < GROUP)
        tl.store(out_ptr + at + D + 1, total, mask=heads < GROUP)


@triton.jit
def _merge_splits_kernel(partial_ptr, out_ptr, SPLITS: tl.constexpr, D: tl.constexpr):
    """One (row, head): the splits' sums rescaled to their common maximum (a split without keys
    has maximum -inf and weighs nothing)."""
    row_head = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    at = (row_head * SPLITS + splits) * (D + 2)
    maxima = tl.load(partial_ptr + at + D)
    scale = tl.exp(maxima - tl.max(maxima, axis=0))
    total = tl.sum(tl.load(partial_ptr + at + D + 1) * scale, axis=0)
    acc = tl.sum(tl.load(partial_ptr + at[:, None] + d[None, :]) * scale[:, None], axis=0)
    tl.store(out_ptr + row_head * D + d, (acc / total).to(out_ptr.dtype.element_ty))
