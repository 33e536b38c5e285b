"""Rows packed by document into sequences of `train.seq_len` tokens.

Rows are placed best-fit decreasing (the longest first, ties in an order drawn from the seed; each
into the sequence it fills best), once, when the run starts: the packed sequences are then read in
an order reshuffled each epoch from the seed, exactly as `TokenDataset` reads its windows, so a
resumed run reads what an uninterrupted one would. A sequence carries, beside its tokens, each
token's label (the token, or -100 where it does not train: a row's first token, its untrained
tokens, the padding that ends the sequence) and its position in its own row: 0 where a row
starts, which is what tells attention and the rotary embedding where each row begins (the model
attends within a row only: `ops/documents.py`). The padding is a row of its own that trains
nothing.

A row longer than `seq_len` follows `data.too_long`: "drop" (counted), "truncate" (its end cut;
dropped if no trained token is left) or "error".
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch

from moemesh.data.chat import Row
from moemesh.errors import DataError


@dataclass
class Packed:
    """Packed sequences [B, T]: tokens, labels (-100: untrained) and positions (0 where a row starts)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index) -> Packed:
        return Packed(self.tokens[index], self.labels[index], self.positions[index])

    def split(self, size: int) -> list[Packed]:
        return [self[i : i + size] for i in range(0, len(self), size)]

    def to(self, device, non_blocking: bool = False) -> Packed:
        return Packed(*(t.to(device, non_blocking=non_blocking) for t in (self.tokens, self.labels, self.positions)))


def best_fit(lengths: np.ndarray, capacity: int, seed: int) -> list[list[int]]:
    """Bins of row indices, each summing to at most `capacity`: best-fit decreasing."""
    ties = np.random.default_rng([seed, 74]).permutation(len(lengths))
    order = np.lexsort((ties, -np.asarray(lengths)))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin), sorted
    for i in order.tolist():
        n = int(lengths[i])
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            bins.append([i])
            room, b = capacity - n, len(bins) - 1
        else:
            room, b = free.pop(k)
            bins[b].append(i)
            room -= n
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


@dataclass
class PackStats:
    rows: int = 0  # rows read
    dropped: dict[str, int] = field(default_factory=dict)  # why -> rows
    truncated: int = 0
    first_dropped: str | None = None  # where the first dropped row is

    def describe(self) -> str:
        parts = [f"{n} {why}" for why, n in self.dropped.items()]
        if self.truncated:
            parts.append(f"{self.truncated} truncated to train.seq_len (data.too_long)")
        return "; ".join(parts)


def fit_rows(rows: list[Row], seq_len: int, too_long: str, source: str) -> tuple[list[Row], PackStats]:
    """The rows that fit `seq_len` after `data.too_long`, and what happened to the others."""
    stats, kept = PackStats(rows=len(rows)), []

    def drop(row: Row, why: str) -> None:
        stats.dropped[why] = stats.dropped.get(why, 0) + 1
        if stats.first_dropped is None:
            stats.first_dropped = f"{source} line {row.line}"

    for row in rows:
        if len(row.ids) > seq_len:
            if too_long == "error":
                raise DataError(
                    f"{source} line {row.line}: the row has {len(row.ids)} tokens, more than train.seq_len={seq_len} "
                    '(data.too_long = "drop" or "truncate" lets it through)'
                )
            if too_long == "drop":
                drop(row, f"longer than train.seq_len={seq_len} dropped (data.too_long)")
                continue
            row = Row(row.ids[:seq_len], row.trained[:seq_len], row.line)
            if not row.trained.any():
                drop(row, "with no trained token left once truncated dropped")
                continue
            stats.truncated += 1
        kept.append(row)
    return kept, stats


def pack(rows: list[Row], seq_len: int, seed: int, pad_id: int) -> Packed:
    """Rows that each fit `seq_len` -> packed sequences (int64 tensors [N, seq_len])."""
    bins = best_fit(np.array([len(r.ids) for r in rows], dtype=np.int64), seq_len, seed)
    tokens = np.full((len(bins), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(bins), seq_len), -100, dtype=np.int64)
    positions = np.zeros((len(bins), seq_len), dtype=np.int64)
    for b, members in enumerate(bins):
        at = 0
        for i in members:
            row = rows[i]
            n = len(row.ids)
            tokens[b, at : at + n] = row.ids
            labels[b, at : at + n] = np.where(row.trained, row.ids, -100)
            positions[b, at : at + n] = np.arange(n)
            at += n
        positions[b, at:] = np.arange(seq_len - at)  # the padding: a row of its own
    return Packed(torch.from_numpy(tokens), torch.from_numpy(labels), torch.from_numpy(positions))


class EpochOrder:
    """The training windows' order in each epoch: a permutation drawn from (seed, epoch), the
    same for raw-text windows (`dataset.TokenDataset`) and packed sequences, kept for the epoch
    being read. Needs `seed`, `num_train_windows` and `_epoch_order` (None at first)."""

    seed: int
    num_train_windows: int
    _epoch_order: tuple[int, np.ndarray] | None

    def _window_order(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = (epoch, rng.permutation(self.num_train_windows))
        return self._epoch_order[1]


class PackedDataset(EpochOrder):
    """Training and validation sequences packed from rows (the last `val_fraction` of the rows
    held out), read as `TokenDataset` reads windows."""

    def __init__(
        self,
        rows: list[Row],
        seq_len: int,
        val_fraction: float,
        seed: int,
        pad_id: int,
        too_long: str = "drop",
        source: str = "data",
    ):
        kept, self.stats = fit_rows(rows, seq_len, too_long, source)
        val_rows = max(1, int(len(kept) * val_fraction)) if len(kept) > 1 else 0
        train_rows, held_out = kept[: len(kept) - val_rows], kept[len(kept) - val_rows :]
        if not train_rows or not held_out:
            dropped = f" ({self.stats.describe()}: the first {self.stats.first_dropped})" if self.stats.dropped else ""
            raise DataError(
                f"{source} has {len(kept)} rows that fit train.seq_len={seq_len}{dropped}: too few for training "
                f"and validation with data.val_fraction={val_fraction}"
            )
        self.seq_len, self.seed = seq_len, seed
        self.train, self.val = pack(train_rows, seq_len, seed, pad_id), pack(held_out, seq_len, seed, pad_id)
        self.num_train_windows, self.num_val_windows = len(self.train), len(self.val)
        self.train_rows, self.val_rows = len(train_rows), len(held_out)
        self.train_tokens = sum(len(r.ids) for r in train_rows)
        self.val_tokens = sum(len(r.ids) for r in held_out)
        self.trained_tokens = sum(int(r.trained.sum()) for r in train_rows)
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def train_sequences(self, start: int, count: int) -> Packed:
        """Sequences start .. start+count-1 of the endless shuffled order."""
        index = [
            int(self._window_order(s // self.num_train_windows)[s % self.num_train_windows])
            for s in range(start, start + count)
        ]
        return self.train[torch.tensor(index, dtype=torch.long)]

    def val_sequences(self, count: int) -> Packed:
        """`count` validation sequences (fewer if there are not that many), always the same ones."""
        count = min(count, self.num_val_windows)
        return self.val[torch.from_numpy(np.linspace(0, self.num_val_windows - 1, count).astype(np.int64))]

    def describe(self) -> str:
        dropped = self.stats.describe()
        return (
            f"{self.stats.rows} rows packed by row into {self.num_train_windows} training and {self.num_val_windows} "
            f"validation sequences: {self.train_tokens} training tokens, {self.trained_tokens} trained"
            + (f"; {dropped} (the first at {self.stats.first_dropped})" if self.stats.dropped else "")
            + (f"; {dropped}" if dropped and not self.stats.dropped else "")
        )
