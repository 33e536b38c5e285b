"""The static key/value cache of decoding.

Every layer's keys and values live in buffers allocated once, [rows, kv_heads, max_len, head_dim]
(sized at the layer's first write, so under tensor parallelism they hold this rank's heads, and
a family's layers may differ in heads and sizes). A row is one sequence; a token at position p
writes entry p of its row. Before a forward the caller names the rows its batch occupies
(`row_start`, the batch's rows following on) and how many entries attention reads (`kv_len`):
the same buffers, the same shapes and no allocation from one step to the next, which is what a
captured CUDA graph needs. Positions come per batch row ([B, T]), so sequences of different
lengths decode side by side; a key is visible to a query when its position is not after the
query's (and, on sliding-window layers, within the window).

Limits: no paging (a row reserves max_len entries), and DeepSeek's latent attention caches its
expanded per-head keys and values, not the latent.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, rows: int, max_len: int):
        self.rows, self.max_len = rows, max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.row_start = 0  # the batch's first row; batch row b is cache row row_start + b
        self.kv_len = max_len  # entries attention reads (they must cover every query's position)

    def update(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v [B, kv_heads, T, D] at `positions` ([T] for every row, or [B, T]) of the
        batch's rows; return the rows' first kv_len keys and values (views, not copies)."""
        batch = k.shape[0]
        rows = torch.arange(batch, device=k.device)[:, None]
        out = []
        for buffer, new in zip(self.buffers(layer_idx, batch, k, v.shape[3]), (k, v)):
            mine = buffer[self.row_start : self.row_start + batch]
            mine[rows, :, positions] = new.transpose(1, 2).to(buffer.dtype)  # [B, T, heads, D] by advanced indexing
            out.append(mine[:, :, : self.kv_len])
        return out[0], out[1]

    def buffers(
        self, layer_idx: int, batch: int, like: torch.Tensor, value_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole key and value buffers (allocated at its first write, in the dtype
        and with the kv heads and key size of `like` [B, kv_heads, T, D]), after checking that
        `batch` rows from row_start and kv_len entries fit."""
        if self.row_start + batch > self.rows or self.kv_len > self.max_len:
            raise ValueError(
                f"rows [{self.row_start}, {self.row_start + batch}) x {self.kv_len} entries do not "
                f"fit a cache of {self.rows} rows x {self.max_len}"
            )
        if layer_idx not in self.keys:
            self.keys[layer_idx] = like.new_zeros(self.rows, like.shape[1], self.max_len, like.shape[3])
            self.values[layer_idx] = like.new_zeros(self.rows, like.shape[1], self.max_len, value_dim)
        return self.keys[layer_idx], self.values[layer_idx]
