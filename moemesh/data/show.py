"""What trains, before a run: `moemesh data --show N` prints the first N sequences in the order
the trainer reads them, each row of a packed sequence apart, its trained tokens marked (coloured on
a terminal, [bracketed] otherwise), with the counts; `--output FILE.jsonl` writes every training
sequence of the first epoch as {"input_ids", "labels", "position_ids"} (labels -100 where
untrained, positions restarting at 0 for each row), as transformers names them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moemesh.data.dataset import TokenDataset
from moemesh.data.packing import Packed, PackedDataset
from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import DataError

_GREEN, _DIM, _RESET = "\x1b[30;42m", "\x1b[2m", "\x1b[0m"


def sequences(dataset: TokenDataset | PackedDataset, count: int) -> Packed:
    """The first `count` training sequences, as the trainer reads them; a text window is one row
    whose every token but the first trains."""
    batch = dataset.train_sequences(0, count)
    if isinstance(batch, Packed):
        return batch
    labels = batch.clone()
    labels[:, 0] = -100  # predicted by nothing in the window (the trainer's shift drops it alike)
    return Packed(batch, labels, torch.arange(batch.shape[1]).expand_as(batch).contiguous())


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    decode = getattr(tokenizer, "decode_special", tokenizer.decode)
    return decode(ids)


def render(tokenizer: Tokenizer, batch: Packed, colour: bool) -> str:
    lines = []
    for s in range(len(batch)):
        tokens, labels, positions = (t.tolist() for t in (batch.tokens[s], batch.labels[s], batch.positions[s]))
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        padded = len(starts) > 2 and all(label == -100 for label in labels[starts[-2] :])  # the last is padding
        trained_in = sum(label != -100 for label in labels)
        rows = len(starts) - 1 - padded
        lines.append(f"── sequence {s}: {rows} rows, {len(tokens)} tokens, {trained_in} trained")
        for r, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            if padded and r == rows:
                lines.append(f"   padding: {b - a} tokens")
                continue
            pieces, i = [], a
            while i < b:  # runs of trained / untrained tokens, each decoded whole
                trained = labels[i] != -100
                j = i
                while j < b and (labels[j] != -100) == trained:
                    j += 1
                text = _text(tokenizer, tokens[i:j])
                if trained:
                    pieces.append(f"{_GREEN}{text}{_RESET}" if colour else f"[{text}]")
                else:
                    pieces.append(f"{_DIM}{text}{_RESET}" if colour else text)
                i = j
            lines.append(f"   row {r} ({b - a} tokens):")
            lines.append("".join(pieces))
    return "\n".join(lines)


def counts(dataset: TokenDataset | PackedDataset) -> str:
    if isinstance(dataset, PackedDataset):
        return dataset.describe()
    return (
        f"{len(dataset.train_tokens)} training tokens (every one trains), {len(dataset.val_tokens)} validation "
        f"tokens, in {dataset.num_train_windows} windows of {dataset.seq_len}"
    )


def write_jsonl(dataset: TokenDataset | PackedDataset, path: Path) -> int:
    """Every training sequence of the first epoch, in the trainer's order; returns how many."""
    batch = sequences(dataset, dataset.num_train_windows)
    try:
        with path.open("w") as f:
            for s in range(len(batch)):
                record = {
                    "input_ids": batch.tokens[s].tolist(),
                    "labels": batch.labels[s].tolist(),
                    "position_ids": batch.positions[s].tolist(),
                }
                f.write(json.dumps(record) + "\n")
    except OSError as e:
        raise DataError(f"cannot write {path}: {e}") from None
    return len(batch)
