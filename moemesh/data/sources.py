"""Reading a data path into one stream of token ids. Documents are joined with the tokenizer's
end-of-document token. Accepted: "stdlib" (the embedded corpus), a UTF-8 text file, a JSONL file
(one {"text": ...} object per line), a directory of such files, or pre-tokenised ids in a `.npy`
file (any integer dtype, one dimension) or a `.bin` file (raw little-endian uint16, as nanoGPT
writes them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moemesh.data.stdlib import stdlib_files
from moemesh.data.tokenizer import ByteTokenizer, Tokenizer
from moemesh.errors import DataError

TOKEN_SUFFIXES = (".npy", ".bin")


def load_tokens(path: str, tokenizer: Tokenizer) -> np.ndarray:
    """All tokens of `path`, as a 1-D integer array."""
    if path == "stdlib":
        return _encode_documents((p.read_bytes() for p in stdlib_files()), tokenizer)
    file = Path(path)
    if not file.exists():
        raise DataError(f"data file not found: {file}")
    if file.suffix in TOKEN_SUFFIXES:
        tokens = _read_token_file(file)
    elif file.is_dir():
        files = sorted(f for f in file.rglob("*") if f.is_file() and not f.name.startswith("."))
        tokens = _encode_documents((doc for f in files for doc in _read_documents(f)), tokenizer)
    else:
        tokens = _encode_documents(_read_documents(file), tokenizer)
    if tokens.size == 0:
        raise DataError(f"data path {file} holds no tokens")
    return tokens


def jsonl_values(file: Path, text: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-empty line of a JSONL file's text."""
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            at = "" if e.msg.endswith(" at") else " at"  # "Unterminated string starting at" names no place
            where = f"{file} line {number} column {e.colno}"
            raise DataError(f"{where}: invalid JSON: {e.msg}{at} column {e.colno}") from None


def _read_documents(file: Path) -> Iterator[str]:
    try:
        text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {file} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if file.suffix != ".jsonl":
        yield text
        return
    for number, record in jsonl_values(file, text):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f'{file} line {number}: expected an object with a "text" string')
        yield record["text"]


def _encode_documents(documents: Iterator[str | bytes], tokenizer: Tokenizer) -> np.ndarray:
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.int32
    pieces = []
    for doc in documents:
        if not doc:
            continue
        if isinstance(tokenizer, ByteTokenizer):
            # The byte tokenizer takes stdlib files as they are, whatever their encoding.
            raw = doc if isinstance(doc, bytes) else doc.encode("utf-8")
            ids = np.frombuffer(raw, dtype=np.uint8)
        else:
            text = doc if isinstance(doc, str) else doc.decode("utf-8", errors="replace")
            ids = np.asarray(tokenizer.encode(text))
        pieces += [ids.astype(dtype), np.asarray(eos, dtype=dtype)]
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)


def _read_token_file(file: Path) -> np.ndarray:
    try:
        if file.suffix == ".npy":
            tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        else:
            if file.stat().st_size % 2:
                raise ValueError("its size is not a whole number of uint16 tokens")
            tokens = np.fromfile(file, dtype="<u2")
    except (OSError, ValueError, EOFError) as e:
        raise DataError(f"cannot read token file {file}: {e}") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"token file {file} must hold a 1-D integer array, got {tokens.dtype} {tokens.shape}")
    return tokens
