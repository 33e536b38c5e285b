"""The paged-attention kernel (ops/decode_attention.py) alone, on the layouts of a packed step:
how the tile table's size, the programs that walk it and the splits of the keys cost.

    PYTHONPATH=. python3 bench/paged_attention.py            (a GPU; bf16, Qwen3-30B-A3B's heads)
    PYTHONPATH=. python3 bench/paged_attention.py --sweep    (the kernel's launch settings, each layout)

Layouts (blocks of 16, random block tables):
  follower  one chunk of 64 tokens after 1,024 cached (a prefix-cache follower's step): 4 tiles
  mixed     64 decode tokens at 200-1,000 cached each, beside a 512-token chunk of a new prompt
            after 0 cached: 96 tiles
  round     a loaded server's prefill round (64 clients, prompts of 512): 60 decode tokens at
            497-625 cached, beside 4 new prompts of 497 tokens (--sweep)
  prompt    one new prompt of 512 tokens (--sweep)
Each layout with its tile table exact (the tiles alone, as a host that knew them would pass) or
with an entry per token (as found on the device: the programs past the tiles do nothing), and
with the keys split as kv_len says (split_count: 1,088 -> 8; a captured step's kv_len is the
cache's row length, 40,960 here -> 16).

--sweep times the round, prompt and mixed layouts as a captured step has them (an entry per
token, kv_len the row length) under each key block (BLOCK_KEYS), pipeline depth (PACKED_STAGES)
and tile size (TILE_ROWS), beside the same prompts' causal attention in PyTorch's flash
kernel (contiguous keys, no decode tokens: a floor, not a peer); each variant's output against
the default's.
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
    elif kind == "round":
        contexts = torch.randint(497, 626, (60,), generator=generator).tolist()
        runs = [(row, n, 1) for row, n in enumerate(contexts)] + [(60 + i, 0, 497) for i in range(4)]
    elif kind == "prompt":
        runs = [(0, 0, 512)]
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


HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 4, 128, 16  # Qwen3-30B-A3B's attention, serve's blocks


def step_inputs(kind: str, max_len: int, generator: torch.Generator, device, dtype) -> dict:
    """A layout's query, pools, block tables and token layout on the device, and its runs."""
    token_rows, positions, spans = layout(kind, generator)
    per_row = -(-max_len // BLOCK_SIZE)
    sequences = int(token_rows.max()) + 1
    used = -(-1600 // BLOCK_SIZE)
    num_blocks = 1 + sequences * used
    tables = torch.zeros(sequences + 1, per_row, dtype=torch.int32)
    tables[:sequences, :used] = (
        (torch.randperm(num_blocks - 1, generator=generator) + 1)[: sequences * used].view(sequences, used).int()
    )
    keys, values = (torch.randn(num_blocks * BLOCK_SIZE, KV_HEADS, DIM, device=device, dtype=dtype) for _ in "kv")
    q = torch.randn(len(positions), HEADS, DIM, device=device, dtype=dtype)
    return dict(
        q=q, keys=keys, values=values, tables=tables.to(device), token_rows=token_rows.to(device),
        positions=positions.to(device), spans=spans,
    )  # fmt: skip


def tile_table(x: dict, per_tile: int, entries: int | None) -> tuple:
    """The layout's tile table with `entries` entries (None: the tiles alone)."""
    real = tiles_of(x["spans"], per_tile, 0, x["q"].device)[3]
    return tiles_of(x["spans"], per_tile, real if entries is None else entries, x["q"].device)


def attend(x: dict, table: tuple, per_tile: int, kv_len: int) -> torch.Tensor:
    starts, lengths, count, _ = table
    return decode_attention.paged_attention(
        x["q"], x["keys"], x["values"], x["tables"], BLOCK_SIZE, x["token_rows"], x["positions"], starts, lengths,
        count, per_tile, kv_len, DIM**-0.5, None,
    )  # fmt: skip


def kernel_us(fn) -> float:
    return median_ms(graphed(fn, 20), warmup=3, repeat=20) / 20 * 1e3


def flash_floor_us(x: dict) -> float:
    """The layout's new prompts alone, causal, contiguous keys, in PyTorch's flash attention."""
    prompts = [(first, n) for first, n in x["spans"] if n > 1]
    if not prompts:
        return float("nan")
    qs = [x["q"][first : first + n].transpose(0, 1)[None] for first, n in prompts]
    ks = [torch.randn(1, KV_HEADS, n, DIM, device=x["q"].device, dtype=x["q"].dtype) for _, n in prompts]

    def run():
        for q, k in zip(qs, ks):
            torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)

    return kernel_us(run)


def sweep(args) -> None:
    device, dtype = "cuda", torch.bfloat16
    module = decode_attention
    defaults = (module.BLOCK_KEYS, module.PACKED_STAGES, module.TILE_ROWS)
    variants = [defaults] + [
        (b, s, r) for r in (64, 128) for b in (32, 64, 128) for s in (1, 2, 3, 4) if (b, s, r) != defaults
    ]
    rows_out = []
    for kind in ("round", "prompt", "mixed"):
        x = step_inputs(kind, args.max_len, torch.Generator().manual_seed(0), device, dtype)
        tokens, reference = len(x["positions"]), None
        floor = flash_floor_us(x)
        for block_keys, stages, tile_rows in variants:
            module.BLOCK_KEYS, module.PACKED_STAGES = block_keys, stages
            per_tile = max(1, tile_rows // (HEADS // KV_HEADS))
            table = tile_table(x, per_tile, tokens)
            try:
                out = attend(x, table, per_tile, args.max_len)
                reference = out if reference is None else reference
                us = kernel_us(lambda: attend(x, table, per_tile, args.max_len))  # noqa: B023
                error = f"{(out.float() - reference.float()).abs().max().item():.1e}"
            except Exception as e:  # a launch setting this GPU cannot run (shared memory, registers)
                us, error = float("nan"), type(e).__name__
            rows_out.append(
                {
                    "layout": f"{kind}: {tokens} tokens, {table[3]} tiles",
                    "BLOCK_KEYS": block_keys,
                    "stages": stages,
                    "TILE_ROWS": tile_rows,
                    "µs a call": f"{us:.1f}",
                    "flash floor µs": f"{floor:.1f}",
                    "max |diff| vs first": error,
                }
            )
        module.BLOCK_KEYS, module.PACKED_STAGES = defaults[:2]
    print_table(rows_out, f"paged attention launch settings, one layer, bf16, {torch.cuda.get_device_name()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-len", type=int, default=40960, help="the cache's row length (a captured step's kv_len)")
    parser.add_argument("--sweep", action="store_true", help="the kernel's launch settings (module doc)")
    args = parser.parse_args()
    if args.sweep:
        return sweep(args)
    device, dtype = "cuda", torch.bfloat16
    per_tile = decode_attention.tile_tokens(HEADS // KV_HEADS)
    rows_out = []
    for kind in ("follower", "mixed"):
        x = step_inputs(kind, args.max_len, torch.Generator().manual_seed(0), device, dtype)
        tokens = len(x["positions"])
        used_keys = int(x["positions"].max()) + 1
        few = -(-tokens // per_tile) * KV_HEADS < 64  # paged_attention splits the keys then
        for table in ("exact", "padded"):
            for kv_len in sorted({used_keys, args.max_len}):
                tiles = tile_table(x, per_tile, None if table == "exact" else tokens)

                def run():
                    return attend(x, tiles, per_tile, kv_len)  # noqa: B023

                rows_out.append(
                    {
                        "layout": f"{kind}: {tokens} tokens, {tiles[3]} tiles",
                        "table entries": len(tiles[0]),
                        "kv_len (splits)": f"{kv_len} ({decode_attention.split_count(kv_len) if few else 1})",
                        "µs a call": f"{kernel_us(run):.1f}",
                    }
                )
    device_name = torch.cuda.get_device_name()
    print_table(rows_out, f"paged attention, one layer, bf16, {device_name}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
