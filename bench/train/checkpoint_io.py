"""What checkpoint integrity costs: a save as moemesh writes it (each file hashed for SHA256SUMS,
every file and directory fsynced, then renamed) against a bare `dcp.save` of the same state, the
verification of the result, and the throughput of the hashes one could have chosen:

    PYTHONPATH=. python3 bench/train/checkpoint_io.py [--gb 8] [--dir /local/nvme/tmp] [--drop-caches]

The state is --gb GB of fp32 tensors of 64 MiB (a model's weights and AdamW's two moments are
such a dict), on the CPU: the figures are those of the file system and the hash, not of a GPU copy.
Verification right after a save reads the files from the page cache; --drop-caches (root only)
empties it first, as a resume on a fresh machine would meet it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from bench.harness import drop_page_cache, print_table, timed
from moemesh.checkpoint import integrity
from moemesh.checkpoint.dcp import save_checkpoint
from moemesh.models import ModelConfig

_TENSOR_BYTES = 64 << 20


def hash_rates(megabytes: int = 512) -> list[dict]:
    """GB/s of each candidate on one thread, over bytes in memory."""
    data = memoryview(os.urandom(megabytes << 20))
    chunks = [data[i : i + (8 << 20)] for i in range(0, len(data), 8 << 20)]

    def digest(name):
        h = hashlib.new(name)
        for chunk in chunks:
            h.update(chunk)

    def crc32():
        value = 0
        for chunk in chunks:
            value = zlib.crc32(chunk, value)

    candidates = {
        "sha256 (chosen)": lambda: digest("sha256"),
        "blake2b": lambda: digest("blake2b"),
        "sha1": lambda: digest("sha1"),
        "crc32 (zlib)": crc32,
    }
    return [
        {"hash": name, "GB/s per thread": f"{len(data) / timed(fn)[0] / 1e9:.2f}"} for name, fn in candidates.items()
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=8.0, help="size of the state to save")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--drop-caches", action="store_true", help="empty the page cache before verifying")
    args = parser.parse_args()

    count = max(1, int(args.gb * 1e9 / _TENSOR_BYTES))
    state = {"model": {f"tensor_{i}": torch.randn(_TENSOR_BYTES // 4) for i in range(count)}}
    size_gb = count * _TENSOR_BYTES / 1e9
    root = Path(tempfile.mkdtemp(prefix="moemesh-ckpt-", dir=args.dir))
    try:
        bare, ours = root / "bare", root / "checkpoints" / "step_1"
        rows = []
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process, as asked
        seconds = timed(lambda: dcp.save(state, checkpoint_id=bare, no_dist=True))[0]
        rows.append({"what": "dcp.save alone", "s": f"{seconds:.2f}", "GB/s": f"{size_gb / seconds:.2f}"})
        seconds = timed(lambda: save_checkpoint(ours, state, ModelConfig()))[0]
        rows.append(
            {
                "what": "save_checkpoint: dcp.save, SHA256SUMS, fsync, rename",
                "s": f"{seconds:.2f}",
                "GB/s": f"{size_gb / seconds:.2f}",
            }
        )
        names = [line.split("  ", 1)[1] for line in (ours / integrity.CHECKSUMS).read_text().splitlines()]
        if args.drop_caches and not drop_page_cache():
            raise SystemExit("--drop-caches: cannot write /proc/sys/vm/drop_caches (it needs root)")
        seconds = timed(lambda: integrity.sha256_of_files(ours, names))[0]
        rows.append(
            {
                "what": f"hashing alone ({len(names)} files, in threads)",
                "s": f"{seconds:.2f}",
                "GB/s": f"{size_gb / seconds:.2f}",
            }
        )
        if args.drop_caches:
            drop_page_cache()
        seconds = timed(lambda: integrity.problem(ours))[0]
        rows.append(
            {
                "what": "verify (sizes + SHA-256 of every file)" + (", cold cache" if args.drop_caches else ""),
                "s": f"{seconds:.2f}",
                "GB/s": f"{size_gb / seconds:.2f}",
            }
        )
        print_table(rows, f"checkpoint of {size_gb:.1f} GB in {root} ({os.cpu_count()} CPUs)")
        print_table(hash_rates(), "hash throughput, one thread, bytes in memory")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
