"""What makes a checkpoint trustworthy: a SHA-256 of each of its files, written beside them when it is
saved and checked before it is used; files and directories flushed to disk (fsync) before the rename
that publishes it; and removals that never leave half a checkpoint under a checkpoint's name.

    step_N/SHA256SUMS    one "<sha256>  <file>" line per file (data, .metadata, config.json,
                         tokenizer.json), the format of `sha256sum`: `cd step_N && sha256sum -c SHA256SUMS`
                         checks a checkpoint by hand

Why a checksum and not only sizes: a file of the right size can still hold the wrong bytes (a disk
or a copy that went bad), and DCP would load them without a word. Hashing costs a read of every
file: the files are split over the ranks (each takes every world-th one) and each rank hashes its
share in threads (hashlib releases the GIL), one file per thread; `bench/train/checkpoint_io.py` measures
what that adds to a save. A checkpoint written before SHA256SUMS existed is checked for its files'
sizes only. SHA256SUMS has no checksum of its own: a damaged line makes its file look corrupted,
which errs on the safe side.

Every function here is collective under a process group: all ranks call it and get the same answer.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from moemesh.parallel import comm

CHECKSUMS = "SHA256SUMS"
TMP_PREFIX = ".tmp-"  # a name that is never a checkpoint's: half-written or being deleted
_HASH_THREADS = 8


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _sha256(path: Path) -> str | None:
    try:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:  # reported by the caller, on every rank alike
        return None


def sha256_of_files(directory: Path, names: list[str]) -> dict[str, str | None]:
    """The SHA-256 of each named file of `directory` (None: unreadable), hashed by all ranks
    together; every rank gets all of them."""
    rank, world = _rank_and_world()
    mine = sorted(names)[rank::world]
    with ThreadPoolExecutor(max(1, min(len(mine), _HASH_THREADS))) as pool:
        digests = dict(zip(mine, pool.map(lambda name: _sha256(directory / name), mine)))
    return {name: digest for part in comm.all_gather_object(digests) for name, digest in part.items()}


def write_checksums(directory: Path, digests: dict[str, str]) -> None:
    write_durably(directory / CHECKSUMS, "".join(f"{digests[name]}  {name}\n" for name in sorted(digests)).encode())


def problem(path: Path) -> str | None:
    """Why the checkpoint directory `path` cannot be trusted, as a phrase that follows its name
    ("is not a complete checkpoint (...)", "is corrupted (...)"), or None when it verifies: every
    file DCP's metadata names is there at its recorded size, and every file SHA256SUMS names
    has its checksum."""
    if not path.is_dir():
        return "is not a checkpoint directory"
    if not (path / ".metadata").is_file():
        return "is not a complete checkpoint (no .metadata)"
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        return f"is not a complete checkpoint (unreadable .metadata: {e})"
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            return f"is not a complete checkpoint ({name} is missing or truncated)"
    if not (path / CHECKSUMS).is_file():
        return None  # written before checksums: the sizes are all there is to check
    expected = {}
    for number, line in enumerate((path / CHECKSUMS).read_text(errors="replace").splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name:
            return f"is corrupted ({CHECKSUMS} line {number} is not '<sha256>  <file>')"
        expected[name] = digest
    for name in sorted(expected):
        if not (path / name).is_file():
            return f"is not a complete checkpoint ({name}, named in {CHECKSUMS}, is missing)"
    actual = sha256_of_files(path, list(expected))
    for name in sorted(expected):
        if actual[name] is None:
            return f"is corrupted ({name} cannot be read)"
        if actual[name] != expected[name]:
            return f"is corrupted ({name} does not match its SHA-256 in {CHECKSUMS})"
    return None


# ---- durability ----------------------------------------------------------------------------------


def fsync(path: Path) -> None:
    """Flush a file, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomically(path: Path, data: bytes) -> None:
    """Replace the file `path` by one holding `data`, durably: written beside it under a temporary
    name and flushed, then renamed over it, so `path` holds either the old bytes or the new ones.
    Not collective: one process writes it."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}")
    try:
        write_durably(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def publish(tmp: Path, path: Path) -> None:
    """Rename the directory `tmp`, whose files are on disk, to `path` (replacing an older `path`),
    durably: its entries first, then the rename in the parent directory."""
    fsync(tmp)
    old = None
    if path.exists():  # rename cannot replace a non-empty directory: move the old one aside first
        old = path.with_name(f"{TMP_PREFIX}replaced-{path.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync(path.parent)
    if old is not None:
        shutil.rmtree(old)


def remove(path: Path) -> None:
    """Delete the directory `path`, first renamed to a temporary name so that a crash half-way
    never leaves part of it under its own name."""
    doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    fsync(path.parent)
    shutil.rmtree(doomed)
