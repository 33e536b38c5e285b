"""Training and validation sequences cut from one token stream.

The training stream is cut into windows of `seq_len` tokens and read in an order reshuffled each
epoch from the seed. Sequence number s of that endless order is a pure function of (seed, s), so
the data position of a run is one integer — the sequences consumed — and a resumed run reads
exactly what an uninterrupted one would. Neither a step's global batch nor its split into
micro-batches depends on the parallel layout: data-parallel ranks take contiguous slices of each
micro-batch.

A JSONL file of conversations or instructions is read row by row instead and packed by row
(`data/chat.py`, `data/packing.py`): its sequences carry labels and positions (`Packed`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from moemesh.config import DataConfig
from moemesh.data.chat import Row, detect_format, read_rows
from moemesh.data.packing import EpochOrder, Packed, PackedDataset
from moemesh.data.sources import jsonl_values, load_tokens
from moemesh.data.template import ChatTemplate, load_chat_template
from moemesh.data.tokenizer import Tokenizer, load_tokenizer
from moemesh.errors import ConfigError, DataError


class TokenDataset(EpochOrder):
    def __init__(self, tokens: np.ndarray, seq_len: int, val_fraction: float, seed: int, source: str = "data"):
        split = int(len(tokens) * (1 - val_fraction))
        self.train_tokens, self.val_tokens = tokens[:split], tokens[split:]
        self.seq_len, self.seed = seq_len, seed
        self.num_train_windows = len(self.train_tokens) // seq_len
        self.num_val_windows = len(self.val_tokens) // seq_len
        if self.num_train_windows == 0 or self.num_val_windows == 0:
            raise DataError(
                f"{source} has {len(tokens)} tokens: too few for one training and one validation sequence of "
                f"train.seq_len={seq_len} tokens with data.val_fraction={val_fraction}"
            )
        self._epoch_order: tuple[int, np.ndarray] | None = None

    def train_sequences(self, start: int, count: int) -> torch.Tensor:
        """Sequences start .. start+count-1 of the endless shuffled order: LongTensor [count, seq_len]."""
        rows = []
        for s in range(start, start + count):
            epoch, index = divmod(s, self.num_train_windows)
            offset = int(self._window_order(epoch)[index]) * self.seq_len
            rows.append(self.train_tokens[offset : offset + self.seq_len])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def val_sequences(self, count: int) -> torch.Tensor:
        """`count` validation windows (fewer if there are not that many), spread evenly over the
        validation stream; always the same ones."""
        count = min(count, self.num_val_windows)
        offsets = np.linspace(0, self.num_val_windows - 1, count).astype(np.int64) * self.seq_len
        return torch.from_numpy(np.stack([self.val_tokens[o : o + self.seq_len] for o in offsets]).astype(np.int64))


def rank_slice(batch: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    """A data-parallel rank's contiguous share of a micro-batch (the micro-batches themselves are
    the same on every layout)."""
    rows = len(batch) // ranks
    return batch[rank * rows : (rank + 1) * rows]


def labels_of(batch: torch.Tensor | Packed) -> torch.Tensor:
    """A (micro-)batch's labels: packed rows carry theirs, a text window's are its tokens."""
    return batch.labels if isinstance(batch, Packed) else batch


def data_format(data: DataConfig) -> str:
    """ "text" (one token stream) or the format of a JSONL file's rows (`data/chat.py`)."""
    path = Path(data.path)
    if data.format == "text" or (data.format == "auto" and (path.suffix != ".jsonl" or not path.is_file())):
        return "text"
    if path.suffix != ".jsonl" or not path.is_file():
        raise DataError(f"data.format = {data.format!r} reads a JSONL file; data.path {data.path} is not one")
    if data.format != "auto":
        return data.format
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break  # said with its place when the file is read
                fmt = detect_format(record, f"{path} line 1")
                return "text" if fmt == "text" else fmt
    return "text"


def load_rows(data: DataConfig, tokenizer: Tokenizer, fmt: str) -> tuple[list[Row], ChatTemplate | None]:
    """Every row of a chat/instruction JSONL file, rendered, tokenized and marked (`data/chat.py`)."""
    path = Path(data.path)
    template = load_chat_template(tokenizer, data.chat_template)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    _, rows = read_rows(path, jsonl_values(path, text), tokenizer, template, fmt, data.train_on)
    return rows, template


def load_dataset(
    data: DataConfig, seq_len: int, seed: int, vocab_size: int
) -> tuple[TokenDataset | PackedDataset, Tokenizer]:
    tokenizer = load_tokenizer(data.tokenizer)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}, data.tokenizer={data.tokenizer!r})"
        )
    fmt = data_format(data)
    if fmt != "text":
        rows, template = load_rows(data, tokenizer, fmt)
        high = max(int(r.ids.max()) for r in rows)
        if high >= vocab_size:
            raise DataError(f"data {data.path} holds token ids up to {high}, outside model.vocab_size={vocab_size}")
        pad = tokenizer.eos_id if tokenizer.eos_id is not None else 0
        dataset = PackedDataset(rows, seq_len, data.val_fraction, seed, pad, data.too_long, source=data.path)
        dataset.format, dataset.template = fmt, template
        return dataset, tokenizer
    tokens = load_tokens(data.path, tokenizer)
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        raise DataError(f"data {data.path} holds token ids in [{low}, {high}], outside model.vocab_size={vocab_size}")
    return TokenDataset(tokens, seq_len, data.val_fraction, seed, source=f"data {data.path}"), tokenizer
