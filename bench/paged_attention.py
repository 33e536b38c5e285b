"""The paged-attention kernel (ops/decode_attention.py) alone, on the layouts of a packed step:
how the tile table's size, the programs that walk it and the splits of the keys cost.

    PYTHONPATH=. python3 bench/paged_attention.py            (a GPU; bf16, Qwen3-30B-A3B's heads)

Layouts (blocks of 16, random block tables):
  follower  one chunk of 64 tokens after 1,024 cached (a prefix-cache follower's step): 4 tiles
  mixed     64 decode tokens at 200-1,000 cached each, beside a 512-token chunk of a new prompt
            after 0 cached: 96 tiles
Each layout with its tile table exact (the tiles alone, as a host that knew them would pass) or
with an entry per token (as found on the device: the programs past the tiles do nothing), and
with the keys split as kv_len says (split_count: 1,088 -> 8; a captured step's kv_len is the
cache's row length, 40,960 here -> 16).
"""

from __future__ import annotations

import argparse

import torch

from bench.common import median_ms, print_table
from moemesh.ops import decode_attention


def layout(kind: str, generator: torch.Generator):
    """(token rows, positions, runs) of the step: runs as (first token, tokens)."""
    if kind == "follower":
        runs = [(0, 1024, 64)]  # (row, first position, tokens)
    else:
        contexts = torch.randint(200, 1000, (64,), generator=generator).tolist()
        runs = [(row, n, 1) for row, n in enumerate(contexts)] + [(64, 0, 512)]
    rows = torch.cat([torch.full((n,), row) for row, _, n in runs])
    positions = torch.cat([torch.arange(start, start + n) for _, start, n in runs])
    first, spans = 0, []
    for _, _, n in runs:
        spans.append((first, n))
        first += n
    return rows, positions, spans


def tiles_of(spans, per_tile: int, entries: int, device):
    starts, lengths = [], []
    for first, n in spans:
        for at in range(first, first + n, per_tile):
            starts.append(at)
            lengths.append(min(per_tile, first + n - at))
    count = len(starts)
    starts += [0] * (entries - count)
    lengths += [0] * (entries - count)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(starts), as_tensor(lengths), as_tensor([count]), count


def graphed(fn, times: int):
    """`times` calls of fn as one CUDA graph's replay: the kernel's time, not its launch's (a Triton
    launch costs the host more than this kernel takes)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(times):
            fn()
    return graph.replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-len", type=int, default=40960, help="the cache's row length (a captured step's kv_len)")
    args = parser.parse_args()
    device, dtype = "cuda", torch.bfloat16
    heads, kv_heads, dim, block_size = 32, 4, 128, 16
    generator = torch.Generator().manual_seed(0)
    per_tile = decode_attention.tile_tokens(heads // kv_heads)
    rows_out = []
    for kind in ("follower", "mixed"):
        token_rows, positions, spans = layout(kind, generator)
        tokens = len(positions)
        per_row = -(-args.max_len // block_size)
        sequences = int(token_rows.max()) + 1
        num_blocks = 1 + sequences * -(-1600 // block_size)
        tables = torch.zeros(sequences + 1, per_row, dtype=torch.int32)
        used = -(-1600 // block_size)
        tables[:sequences, :used] = (
            (torch.randperm(num_blocks - 1, generator=generator) + 1)[: sequences * used].view(sequences, used).int()
        )
        keys, values = (torch.randn(num_blocks * block_size, kv_heads, dim, device=device, dtype=dtype) for _ in "kv")
        q = torch.randn(tokens, heads, dim, device=device, dtype=dtype)
        tables, token_rows, positions = tables.to(device), token_rows.to(device), positions.to(device)
        used_keys = int(positions.max()) + 1
        few = -(-tokens // per_tile) * kv_heads < 64  # paged_attention splits the keys then
        for table in ("exact", "padded"):
            real = tiles_of(spans, per_tile, 0, device)[3]
            starts, lengths, count, _ = tiles_of(spans, per_tile, real if table == "exact" else tokens, device)
            for kv_len in sorted({used_keys, args.max_len}):

                def run():
                    return decode_attention.paged_attention(
                        q, keys, values, tables, block_size, token_rows, positions, starts, lengths, count,
                        per_tile, kv_len, dim**-0.5, None,
                    )  # fmt: skip

                ms = median_ms(graphed(run, 20), warmup=3, repeat=20) / 20
                rows_out.append(
                    {
                        "layout": f"{kind}: {tokens} tokens, {real} tiles",
                        "table entries": len(starts),
                        "kv_len (splits)": f"{kv_len} ({decode_attention.split_count(kv_len) if few else 1})",
                        "µs a call": f"{ms * 1e3:.1f}",
                    }
                )
    device_name = torch.cuda.get_device_name()
    print_table(rows_out, f"paged attention, one layer, bf16, {device_name}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
