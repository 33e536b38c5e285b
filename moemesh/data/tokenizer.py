"""Tokenizers: raw bytes (the default, needs nothing) or a Hugging Face `tokenizer.json`."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from moemesh.errors import DataError


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None  # ends a document; generation stops there

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Each byte of the UTF-8 text is a token. Byte 0 never occurs in text files, so it marks the
    end of a document and the vocabulary stays exactly 256."""

    vocab_size = 256
    eos_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:  # no special tokens
        return bytes(i for i in ids if 0 < i < 256).decode("utf-8", errors="replace")


# Spellings of the end-of-document token in common tokenizer.json files.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")


class HFTokenizer:
    """A `tokenizer.json` read by the `tokenizers` package."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise DataError(f"tokenizer file not found: {path} (a tokenizer is 'bytes' or a tokenizer.json file)")
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError:
            raise DataError(f"the tokenizer {path} needs the `tokenizers` package: pip install tokenizers") from None
        try:
            self._tokenizer = _Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception for any bad file
            raise DataError(f"cannot read tokenizer {path}: {e}") from None
        self.path = path
        self.vocab_size = self._tokenizer.get_vocab_size()
        ids = (self._tokenizer.token_to_id(name) for name in _EOS_NAMES)
        self.eos_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (a chat turn's markers, gpt-oss's channels) kept when
        not `skip_special_tokens` (the output parsers read them)."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_special(self, ids: list[int]) -> str:
        """The text of `ids` with the special tokens written out (`<|im_end|>`), for display."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """(ids, the character where each token starts in `text`)."""
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [start for start, _ in encoding.offsets]


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """ "bytes" or the path of a tokenizer.json."""
    return ByteTokenizer() if str(spec) == "bytes" else HFTokenizer(spec)
