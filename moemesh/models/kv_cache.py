"""The paged key/value cache of decoding and serving.

Storage is one pool of fixed-size blocks per layer, keys [num_blocks, block_size, kv_heads, D]
and values beside them (allocated at the layer's first write, in the dtype and with the heads of
what it writes: under tensor parallelism this rank's heads, and a family's layers may differ).
DeepSeek's latent attention writes one "head" of kv_lora_rank + rope dims and no values (its
values are the latent, the keys' first kv_lora_rank dims): the latent, not the expanded heads.

A sequence's entries live in the blocks its row of `block_tables` names: entry p of the row's
sequence is slot block_tables[row, p // block_size] · block_size + p % block_size. Who owns which
block is the allocator's business (inference/blocks.py); here a block is storage. Block 0 is
the null block, never handed out: a table's unused entries point at it, and so does the scratch
row (the last row, all zeros) that the padding tokens of a fixed-size batch write into.

Before a forward the caller lays out its tokens with `set_step`: for each token (in the batch's
flattened [B, T] order) the table row of its sequence and its position. Two shapes of step:
  * decode (segments None): token i is a sequence of its own whose last token it is; attention
    reads each token's row up to its position. Shapes depend only on the number of tokens and
    `kv_len` (a bound on the keys read), which is what a captured CUDA graph needs.
  * packed: runs of consecutive tokens of one sequence — chunks of prompts beside single decode
    tokens, in one forward — each a causal block against its own cached prefix. A run is where
    the row stays the same and the position goes up by one. The attention kernel's tiles (runs
    of at most so many tokens) are found on the device from the tokens' rows and positions, so
    that a packed step of a given size is one fixed sequence of kernels that a CUDA graph can
    capture and replay with other runs. The eager reference attention reads the runs on the
    host instead (`segments`: (row, first token, tokens, keys to read)); a step laid out without
    them (a captured one) refuses that path.
A key is visible to a query of the same sequence when its position is not after the query's
(and, on sliding-window layers, within the window). New keys are written before attention
reads, so a chunk attends to itself through the cache too.
"""

from __future__ import annotations

import math

import torch

Segment = tuple[int, int, int, int]  # (table row, first token, tokens, keys to read: last position + 1)


class HostLayoutMissing(RuntimeError):
    """A layer needs the step's runs on the host, and the step was laid out without them."""


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int, rows: int, max_len: int, device: torch.device | str = "cpu"):
        if num_blocks < 2 or block_size < 1 or rows < 1 or max_len < 1:
            raise ValueError(
                f"a paged cache needs >= 2 blocks (block 0 is the null block), a block size, rows and a "
                f"length >= 1; got {num_blocks} blocks of {block_size}, {rows} rows of {max_len}"
            )
        self.num_blocks, self.block_size, self.rows, self.max_len = num_blocks, block_size, rows, max_len
        self.blocks_per_row = math.ceil(max_len / block_size)
        # One more row than sequences: the scratch row of padding tokens (all null block).
        self.block_tables = torch.zeros(rows + 1, self.blocks_per_row, dtype=torch.int32, device=device)
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor | None] = {}
        # The step's layout (set_step): per token its table row, position and slot.
        self.token_rows = self.positions = self.slots = None
        self.packed = False
        self._segments: list[Segment] | None = None
        self.kv_len = 0
        self._tiles: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def scratch_row(self) -> int:
        return self.rows

    # ---- the step's layout ----------------------------------------------------------------------
    def set_step(
        self,
        token_rows: torch.Tensor,
        positions: torch.Tensor,
        kv_len: int,
        segments: list[Segment] | None = None,
        packed: bool | None = None,
    ) -> None:
        """Lay out the next forward's tokens: token_rows and positions [N] (device tensors, in the
        batch's flattened order); kv_len bounds every key read (> every position, <= max_len).
        A packed step (default: when segments are given) may come without its segments on the
        host: then only the attention kernels serve it (see the module docstring)."""
        if kv_len > self.max_len:
            raise ValueError(f"{kv_len} entries do not fit a cache of rows of {self.max_len}")
        self.token_rows, self.positions = token_rows.contiguous(), positions.contiguous()  # the kernels' layout
        self.kv_len, self._segments = kv_len, segments
        self.packed = segments is not None if packed is None else packed
        blocks = self.block_tables[self.token_rows, self.positions // self.block_size].long()
        self.slots = blocks * self.block_size + self.positions % self.block_size
        self._tiles = {}

    @property
    def segments(self) -> list[Segment] | None:
        """A packed step's runs on the host (None for a decode step)."""
        if self.packed and self._segments is None:
            raise HostLayoutMissing(
                "this packed step was laid out on the device only (a CUDA graph's); attention that "
                "reads the runs on the host (the eager reference) cannot serve it"
            )
        return self._segments

    def tiles(self, tokens_per_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Work units of the attention kernel: (first token [n], tokens [n], tiles [1],
        tokens_per_tile), runs of at most tokens_per_tile tokens of one sequence, in token order
        (a decode step: one token each). A packed step's table has as many entries as tokens;
        those past its `tiles` are empty (0 tokens from token 0)."""
        if not self.packed:
            tokens_per_tile = 1
        if tokens_per_tile not in self._tiles:
            rows, positions = self.token_rows, self.positions
            index = torch.arange(rows.shape[0], device=rows.device)
            if not self.packed:
                starts, lengths, count = index, torch.ones_like(index), torch.full_like(index[:1], len(index))
            else:  # all on the device, no host sync: a run starts where the row or the position jumps
                starts_run = torch.ones_like(rows, dtype=torch.bool)
                starts_run[1:] = (rows[1:] != rows[:-1]) | (positions[1:] != positions[:-1] + 1)
                run_start = torch.where(starts_run, index, 0).cummax(0).values
                tile = ((index - run_start) % tokens_per_tile == 0).cumsum(0) - 1  # each token's tile
                starts = torch.zeros_like(index).scatter_reduce(0, tile, index, "amin", include_self=False)
                lengths = torch.zeros_like(index).scatter_add(0, tile, torch.ones_like(index))
                count = tile[-1:] + 1
            self._tiles[tokens_per_tile] = (starts.int(), lengths.int(), count.int())
        return (*self._tiles[tokens_per_tile], tokens_per_tile)

    # ---- storage --------------------------------------------------------------------------------
    def pools(
        self, layer_idx: int, like_k: torch.Tensor, value_dim: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer's key and value pools, flat [num_blocks · block_size, kv_heads, D] (allocated at
        its first use with the kv heads, key size and dtype of `like_k` [..., kv_heads, D]; no
        value pool when value_dim is None)."""
        if layer_idx not in self.keys:
            slots, heads = self.num_blocks * self.block_size, like_k.shape[-2]
            self.keys[layer_idx] = like_k.new_zeros(slots, heads, like_k.shape[-1])
            self.values[layer_idx] = None if value_dim is None else like_k.new_zeros(slots, heads, value_dim)
        return self.keys[layer_idx], self.values[layer_idx]

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Put the step's new keys and values, [N, kv_heads, D] in token order, at their slots."""
        keys, values = self.pools(layer_idx, k, None if v is None else v.shape[-1])
        keys.index_copy_(0, self.slots, k.to(keys.dtype))
        if v is not None:
            values.index_copy_(0, self.slots, v.to(values.dtype))

    def gather(
        self, layer_idx: int, rows: torch.Tensor | int, entries: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first `entries` (rounded up to whole blocks) keys and values of each of `rows` [n]
        (or of one row), read through their block tables: [n, kv_heads, L, D] copies."""
        tables = self.block_tables[rows : rows + 1] if isinstance(rows, int) else self.block_tables[rows]
        blocks = tables[:, : math.ceil(entries / self.block_size)].long()
        out = []
        for pool in (self.keys[layer_idx], self.values[layer_idx]):
            if pool is None:
                out.append(None)
                continue
            paged = pool.view(self.num_blocks, self.block_size, *pool.shape[1:])[blocks]  # [n, b, bs, heads, D]
            out.append(paged.flatten(1, 2).transpose(1, 2))
        return out[0], out[1]

    def bytes_per_block(self) -> int:
        """What one block takes over all layers written so far."""
        return sum(t.nbytes for t in [*self.keys.values(), *self.values.values()] if t is not None) // self.num_blocks
