"""The block mask of packed rows (`ops/documents.document_block_mask`), made a tile at a time:
its full tiles are torch's `create_block_mask`'s (built from every pair) exactly, its partial tiles
hold every tile with an allowed pair (exactly torch's without a window; with one, a superset: the
kernel evaluates the mask there), and flex attention through it gives the dense masked
attention's output (CPU, fp32, 1e-5: the same sums in another order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from moemesh.ops import documents

# flex attention uncompiled on a CPU: torch's reference, the one to compare with here
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _positions(rows: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def _random_rows(generator: torch.Generator, batch: int, seq: int) -> list[list[int]]:
    rows = []
    for _ in range(batch):
        lengths, left = [], seq
        while left:
            n = min(left, int(torch.randint(1, 400, (), generator=generator)))
            lengths.append(n)
            left -= n
        rows.append(lengths)
    return rows


def _dense_tiles(counts: torch.Tensor, indices: torch.Tensor, tiles: int) -> torch.Tensor:
    dense = torch.zeros(*counts.shape, tiles, dtype=torch.bool)
    for index in torch.cartesian_prod(*(torch.arange(n) for n in counts.shape)).tolist():
        dense[(*index, indices[(*index,)][: counts[(*index,)]])] = True
    return dense


@pytest.mark.parametrize("window", [None, 100, 300])
@pytest.mark.parametrize("seq", [1024, 1000])  # a partial last tile too
def test_tiles_match_torch_built_from_every_pair(seq, window):
    generator = torch.Generator().manual_seed(seq + (window or 0))
    rows = [[seq], [128, 128, seq - 256], *_random_rows(generator, 3, seq)]
    positions = _positions(rows)
    ours = documents.document_block_mask(positions, window)
    ids = documents.document_ids(positions)

    def mask_mod(b, h, q, k):
        allowed = (ids[b, q] == ids[b, k]) & (k <= q)
        return allowed & (k > q - window) if window is not None else allowed

    theirs = create_block_mask(mask_mod, len(rows), None, seq, seq, device="cpu")
    tiles = -(-seq // 128)
    assert ours.kv_num_blocks.shape == theirs.kv_num_blocks.shape
    full = [_dense_tiles(m.full_kv_num_blocks, m.full_kv_indices, tiles) for m in (ours, theirs)]
    partial = [_dense_tiles(m.kv_num_blocks, m.kv_indices, tiles) for m in (ours, theirs)]
    assert torch.equal(*full)
    assert (partial[1] <= partial[0]).all(), "a tile with an allowed pair is missing"
    if window is None:
        assert torch.equal(*partial)
    assert ours.q_num_blocks is not None  # the backward's transposed tiles


@pytest.mark.parametrize("window", [None, 150])
def test_flex_attention_through_it_is_the_dense_masked_attention(window):
    generator = torch.Generator().manual_seed(7)
    positions = _positions([[300, 212], [5, 507], *_random_rows(generator, 1, 512)])
    q, k, v = (torch.randn(3, h, 512, 32, generator=generator) for h in (4, 2, 2))
    got = flex_attention(q, k, v, block_mask=documents.document_block_mask(positions, window), enable_gqa=True)
    mask = documents.document_mask(positions, window)[:, None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
