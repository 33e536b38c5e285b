"""Attention within packed rows (documents): block-causal attention for sequences that hold several
rows, each told by its positions, which restart at 0 where a row starts (`data/packing.py`). A
query attends to the keys of its own row up to itself, so a packed sequence computes what its rows
compute one by one.

The mask is made from the positions once per forward, not once per layer: a one-entry cache keyed
by the positions tensor itself (the one tensor every layer of a forward receives). On CUDA the
attention is flex attention with a block mask (its kernel skips the blocks of other rows: the work
of attention over the rows one by one, not over the whole sequence); elsewhere, or while a CUDA
graph is being captured, torch's scaled_dot_product_attention with the boolean [B, 1, T, T] mask.

The block mask is computed a block at a time (`document_block_mask`): which 128 × 128 tiles of
the [T, T] scores hold an allowed pair, and which hold only allowed pairs, from each tile's first
and last row numbers. torch's `create_block_mask` evaluates the mask at every (query, key) pair
first — [T, T] tensors of int64 row numbers, 128 MiB each at T = 4,096, made in every forward
(inside a CUDA graph, in the graph's pool).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

_cache: dict[str, tuple] = {}  # kind -> (weak reference to the positions, window, the mask)
_flex_failed: list[str] = []  # why flex attention was given up, once


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """[B, T] positions -> [B, T] row numbers: a row starts where its position is 0."""
    return (positions == 0).cumsum(-1)


def document_mask(positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [B, T, T]: True where query i may attend key j (same row, j <= i, and within
    `window` tokens where there is one)."""
    ids = document_ids(positions)
    index = torch.arange(positions.shape[-1], device=positions.device)
    allowed = (ids[:, :, None] == ids[:, None, :]) & (index[None, :] <= index[:, None])
    if window is not None:
        allowed &= index[None, :] > index[:, None] - window
    return allowed


def document_block_mask(positions: torch.Tensor, window: int | None = None, block: int = 128):
    """flex attention's BlockMask of `document_mask(positions, window)`, made from tiles of
    `block` × `block` pairs, not from the pairs: a tile is full where its queries and keys all lie
    in one row, each key at or before each query and within the window; it is partial (the mask
    evaluated inside the kernel) where a pair may be allowed: on the diagonal, or where the rows of
    its keys reach those of its queries. A tile the sequence's end cuts is partial. Rows are
    contiguous, so their numbers do not decrease along the sequence: a tile's rows are those
    between its first and last token's."""
    from torch.nn.attention.flex_attention import BlockMask

    seq = positions.shape[-1]
    ids = document_ids(positions)

    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)
        return allowed & (kv_idx > q_idx - window) if window is not None else allowed

    first = torch.arange(0, seq, block, device=positions.device)  # each tile's first token
    last = (first + block - 1).clamp(max=seq - 1)
    first_id, last_id = ids[:, first], ids[:, last]  # [B, blocks]
    q_first, q_last = first[:, None], last[:, None]  # queries along dim -2, keys along dim -1
    same_row = first_id[:, None, :] == last_id[:, :, None]  # [B, q, k]: the keys' first row is the queries' last
    reaches = last_id[:, None, :] >= first_id[:, :, None]  # the keys' last row reaches the queries' first
    whole = first + block <= seq  # a tile cut by the sequence's end is never full (as torch pads it)
    full = same_row & (last[None, :] <= q_first) & whole[None, :] & whole[:, None]
    partial = reaches & (first[None, :] <= q_last)
    if window is not None:
        full &= first[None, :] > q_last - window
        partial &= last[None, :] > q_first - window
    partial &= ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [B, 1, q, k] -> counts, indices
        dense = dense[:, None].to(torch.int32)
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return dense.sum(-1, dtype=torch.int32), indices

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(seq, seq)
    )


def _cached(kind: str, positions: torch.Tensor, window: int | None, make):
    entry = _cache.get(kind)
    if entry is not None and entry[0]() is positions and entry[1] == window:
        return entry[2]
    value = make()
    _cache[kind] = (weakref.ref(positions), window, value)
    return value


def _flex_ok(q: torch.Tensor) -> bool:
    """Flex attention on CUDA; inside a CUDA graph's capture only once compiled (an eager step ran
    it: the trainer's warm-up does), its block mask then made inside the graph, so that a replay
    computes it again from the positions it is given."""
    if not q.is_cuda or _flex_failed:
        return False
    return _compiled_flex is not None or not torch.cuda.is_current_stream_capturing()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, h, T, D], k [B, h_kv, T, D], v [B, h_kv, T, Dv], positions [B, T] -> [B, h, T, Dv]."""
    gqa = q.shape[1] != k.shape[1]
    if _flex_ok(q):
        try:
            return _flex(q, k, v, positions, scale, window, gqa)
        except Exception as e:  # a shape or build flex does not take: the masked SDPA from now on
            _flex_failed.append(f"{type(e).__name__}: {e}")
    mask = _cached("dense", positions, window, lambda: document_mask(positions, window)[:, None])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


_compiled_flex = None


def _flex(q, k, v, positions, scale, window, gqa):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)

    capturing = torch.cuda.is_current_stream_capturing()  # not the eager warm-up's mask: this graph's own
    block_mask = _cached(
        "block-captured" if capturing else "block", positions, window, lambda: document_block_mask(positions, window)
    )
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def check_rows(positions: torch.Tensor) -> None:
    """Refuses [B, T] positions that are not packed rows: each 0 or the one before it plus 1."""
    step = positions[..., 1:] - positions[..., :-1]
    if not bool(((positions[..., 1:] == 0) | (step == 1)).all()) or not bool((positions[..., :1] == 0).all()):
        raise ValueError("positions without a cache must be packed rows: 0 where a row starts, then 1, 2, ...")
