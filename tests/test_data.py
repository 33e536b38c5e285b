"""Data: the stdlib corpus, file formats, tokenizers, the shuffled order and its errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from moemesh.config import DataConfig
from moemesh.data.dataset import TokenDataset, load_dataset, rank_slice
from moemesh.data.sources import load_tokens
from moemesh.data.stdlib import stdlib_files
from moemesh.data.tokenizer import ByteTokenizer, load_tokenizer
from moemesh.errors import ConfigError, DataError


def test_stdlib_corpus_is_the_standard_library_in_a_fixed_order():
    files = stdlib_files()
    root = Path(sysconfig.get_paths()["stdlib"])
    assert root / "os.py" in files and root / "json" / "decoder.py" in files
    assert not any("site-packages" in f.parts for f in files)
    assert files == stdlib_files()
    assert files != sorted(files)  # hashed order, so the validation tail samples all modules


def test_byte_tokens_of_the_stdlib_separate_files_with_byte_zero():
    tokens = load_tokens("stdlib", ByteTokenizer())
    files = [f for f in stdlib_files() if f.stat().st_size > 0]  # empty files add nothing
    assert int((tokens == 0).sum()) == len(files)
    first = files[0].read_bytes()
    assert bytes(tokens[: len(first)].astype(np.uint8)) == first and tokens[len(first)] == 0


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = ByteTokenizer()
    text = "naïve → ünïcode"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert max(tokenizer.encode(text)) < 256 and 0 not in tokenizer.encode(text)


def test_text_jsonl_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("ab")
    (tmp_path / "b.jsonl").write_text('{"text": "cd"}\n\n{"text": "e"}\n')
    tokenizer = ByteTokenizer()
    assert load_tokens(str(tmp_path / "a.txt"), tokenizer).tolist() == [97, 98, 0]
    assert load_tokens(str(tmp_path / "b.jsonl"), tokenizer).tolist() == [99, 100, 0, 101, 0]
    assert load_tokens(str(tmp_path), tokenizer).tolist() == [97, 98, 0, 99, 100, 0, 101, 0]


def test_pretokenised_npy_and_bin_files(tmp_path):
    ids = np.array([5, 1000, 65535, 7], dtype=np.uint16)
    np.save(tmp_path / "t.npy", ids.astype(np.int64))
    ids.tofile(tmp_path / "t.bin")
    assert load_tokens(str(tmp_path / "t.npy"), ByteTokenizer()).tolist() == ids.tolist()
    assert load_tokens(str(tmp_path / "t.bin"), ByteTokenizer()).tolist() == ids.tolist()


def test_tokenizer_json_through_the_tokenizers_package(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "def": 2, "return": 3, "x": 4}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    assert tokenizer.vocab_size == 5 and tokenizer.eos_id == 1
    assert tokenizer.encode("def x return y") == [2, 4, 3, 0]
    (tmp_path / "code.txt").write_text("def x")
    assert load_tokens(str(tmp_path / "code.txt"), tokenizer).tolist() == [2, 4, 1]


def _dataset(n_tokens=1000, seq_len=10, seed=0):
    return TokenDataset(np.arange(n_tokens) % 256, seq_len=seq_len, val_fraction=0.1, seed=seed)


def test_training_order_is_a_pure_function_of_the_position():
    data = _dataset()
    whole = data.train_sequences(0, 12)
    assert torch.equal(data.train_sequences(5, 4), whole[5:9])
    assert not torch.equal(_dataset(seed=1).train_sequences(0, 12), whole)


def test_each_epoch_visits_every_training_window_once():
    data = _dataset()
    assert data.num_train_windows == 90
    first, second = data.train_sequences(0, 90), data.train_sequences(90, 90)
    windows = sorted(tuple(row) for row in (torch.arange(900) % 256).view(90, 10).tolist())
    assert sorted(map(tuple, first.tolist())) == windows
    assert sorted(map(tuple, second.tolist())) == windows
    assert not torch.equal(first, second)  # reshuffled each epoch


def test_validation_is_the_held_out_tail():
    data = _dataset()
    val = data.val_sequences(100)
    assert val.shape == (10, 10)  # only as many windows as the tail holds
    assert torch.equal(val[0], torch.arange(900, 910) % 256)
    assert torch.equal(data.val_sequences(3), data.val_sequences(3))


def test_data_parallel_ranks_take_contiguous_slices_of_each_micro_batch():
    micro_batch = torch.arange(4 * 3).view(4, 3)
    assert torch.equal(rank_slice(micro_batch, 0, ranks=1), micro_batch)
    halves = [rank_slice(micro_batch, rank, ranks=2) for rank in range(2)]
    assert [h.shape for h in halves] == [(2, 3), (2, 3)]
    assert torch.equal(torch.cat(halves), micro_batch)


@pytest.mark.parametrize(
    "write, message",
    [
        (None, "data file not found"),
        (lambda p: p.with_suffix(".npy").write_bytes(b"not numpy"), "cannot read token file"),
        (lambda p: p.with_suffix(".bin").write_bytes(b"abc"), "not a whole number of uint16 tokens"),
        (
            lambda p: p.with_suffix(".jsonl").write_text('{"text": "ok"}\n{"text": "cut\n'),
            "line 2 column 10: invalid JSON: Unterminated string starting at column 10$",
        ),
        (
            lambda p: p.with_suffix(".jsonl").write_text('{"text": "a" "b"}\n'),
            "line 1 column 14: invalid JSON: Expecting ',' delimiter at column 14$",
        ),
        (lambda p: p.with_suffix(".jsonl").write_text('{"body": "x"}\n'), 'line 1: expected an object with a "text"'),
        (lambda p: p.with_suffix(".txt").write_bytes(b"caf\xe9"), "is not UTF-8 text"),
        (lambda p: p.with_suffix(".txt").write_text(""), "holds no tokens"),
    ],
)
def test_bad_data_files_are_named(tmp_path, write, message):
    path = tmp_path / "data.txt"
    if write is not None:
        write(path)
        path = next(tmp_path.iterdir())
    with pytest.raises(DataError, match=message) as error:
        load_tokens(str(path), ByteTokenizer())
    assert str(path) in str(error.value)


def test_token_ids_beyond_the_vocabulary_and_tiny_data(tmp_path):
    np.save(tmp_path / "big.npy", np.array([1, 2, 300] * 100))
    with pytest.raises(DataError, match=r"token ids in \[1, 300\], outside model.vocab_size=256"):
        load_dataset(DataConfig(path=str(tmp_path / "big.npy")), seq_len=8, seed=0, vocab_size=256)
    (tmp_path / "small.txt").write_text("x" * 50)
    with pytest.raises(DataError, match="too few for one training and one validation sequence"):
        load_dataset(DataConfig(path=str(tmp_path / "small.txt")), seq_len=32, seed=0, vocab_size=256)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match=r"model.vocab_size \(100\) is smaller than the tokenizer's vocabulary \(256"):
        load_dataset(DataConfig(), seq_len=8, seed=0, vocab_size=100)
