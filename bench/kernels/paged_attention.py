"""The paged-attention kernel (ops/decode_attention.py) alone, on the layouts of a packed step:
how the tile table's size, the programs that walk it and the splits of the keys cost.

    PYTHONPATH=. python3 bench/kernels/paged_attention.py            (a GPU; bf16, Qwen3-30B-A3B's heads)
    PYTHONPATH=. python3 bench/kernels/paged_attention.py --sweep    (the kernel's launch settings, each layout)
    PYTHONPATH=. python3 bench/kernels/paged_attention.py --varlen   (new prompts in PyTorch's flash attention)
    PYTHONPATH=. python3 bench/kernels/paged_attention.py --decode-sweep   (a decode step's launch settings)

Layouts (blocks of 16, random block tables):
  follower  one chunk of 64 tokens after 1,024 cached (a prefix-cache follower's step): 4 tiles
  mixed     64 decode tokens at 200-1,000 cached each, beside a 512-token chunk of a new prompt
            after 0 cached: 96 tiles
  round     a loaded server's prefill round (64 clients, prompts of 512): 60 decode tokens at
            497-625 cached, beside 4 new prompts of 497 tokens (--sweep)
  prompt    one new prompt of 512 tokens (--sweep)
Each layout with its tile table exact (the tiles alone, as a host that knew them would pass) or
with an entry per token (as found on the device: the programs past the tiles do nothing), and
with the keys split as split_count says (at most one split per two blocks of kv_len's keys: a
captured step's kv_len is the cache's row length, 40,960 here).

--varlen asks whether PyTorch's flash attention (FA2 through `aten._flash_attention_forward`, varlen)
should take a packed step's new prompts from the kernel: each layout of D decode tokens (as in
"round") beside P new prompts of L tokens, padded to its packed bucket, times the kernel on every
tile, the kernel on the decode tokens' tiles alone, and flash on the prompts (contiguous keys
gathered from the cache by slot; the other tokens in filler segments without keys, the segment
list padded to a fixed length as a CUDA graph needs, the longest segment the bucket); the
prompts' outputs against the kernel's.

--decode-sweep times a decode step's attention (--decode-layouts: B tokens at about C cached each,
kv_len the engine's bucket) under each key block (DECODE_BLOCK_KEYS), pipeline depth
(DECODE_STAGES) and number of splits (forced, in place of split_count's), and prints each
layout's default beside its fastest; --out takes every variant's timing.

--sweep times the round, prompt and mixed layouts as a captured step has them (an entry per
token, kv_len the row length) under each key block (BLOCK_KEYS), pipeline depth (PACKED_STAGES)
and tile size (TILE_ROWS), beside the same prompts' causal attention in PyTorch's flash
kernel (contiguous keys, no decode tokens: a floor, not a peer); each variant's output against
the default's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch

from bench.harness import describe_device, median_ms, print_table
from moemesh.inference.engine import PACKED_BUCKET_STEP
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
    elif kind.startswith("decode"):  # "decode:B:C": a decode step of B tokens at about C cached each
        batch, context = map(int, kind.split(":")[1:])
        contexts = torch.randint(max(1, context - 64), context + 64, (batch,), generator=generator).tolist()
        runs = [(row, n, 1) for row, n in enumerate(contexts)]
    elif "+" in kind:  # "D+PxL": D decode tokens as in "round" beside P new prompts of L tokens
        decodes, prompts = kind.split("+")
        count, length = map(int, prompts.split("x"))
        contexts = torch.randint(497, 626, (int(decodes),), generator=generator).tolist()
        runs = [(row, n, 1) for row, n in enumerate(contexts)] + [(len(contexts) + i, 0, length) for i in range(count)]
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
    used = -(-max(1600, int(positions.max()) + 1) // BLOCK_SIZE)
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


def padded(x: dict, tokens: int) -> dict:
    """The step padded to `tokens` as a captured one is: token 0 at position 0 of the scratch row."""
    pad, device = tokens - len(x["positions"]), x["q"].device
    scratch = x["tables"].shape[0] - 1
    return dict(
        x,
        q=torch.cat([x["q"], torch.randn(pad, HEADS, DIM, device=device, dtype=x["q"].dtype)]),
        token_rows=torch.cat([x["token_rows"], torch.full((pad,), scratch, device=device)]),
        positions=torch.cat([x["positions"], torch.zeros(pad, dtype=torch.long, device=device)]),
        spans=x["spans"] + [(len(x["positions"]) + i, 1) for i in range(pad)],
    )


def varlen(args) -> None:
    device, dtype = "cuda", torch.bfloat16
    per_tile = decode_attention.tile_tokens(HEADS // KV_HEADS)
    rows_out = []
    for kind in ("60+1x512", "60+2x512", "60+3x512", "0+4x512", "0+1x2048"):
        x = step_inputs(kind, args.max_len, torch.Generator().manual_seed(0), device, dtype)
        bucket = -(-len(x["positions"]) // PACKED_BUCKET_STEP) * PACKED_BUCKET_STEP  # the engine's above 256 tokens
        x = padded(x, bucket)
        every = tile_table(x, per_tile, bucket)
        reference = attend(x, every, per_tile, args.max_len)
        decodes = tile_table(dict(x, spans=[s for s in x["spans"] if s[1] == 1]), per_tile, bucket)
        blocks = x["tables"][x["token_rows"], x["positions"] // BLOCK_SIZE].long()
        slots = blocks * BLOCK_SIZE + x["positions"] % BLOCK_SIZE
        prompt = torch.zeros(bucket, dtype=torch.bool, device=device)
        bounds = [0]
        for first, n in x["spans"]:
            if n > 1:
                prompt[first : first + n] = True
                bounds += [first] * (first > bounds[-1]) + [first + n]
        bounds += [bucket] * (bounds[-1] < bucket)
        order = torch.argsort((~prompt).int(), stable=True)  # the prompts' tokens first: their keys, contiguous

        def gather():
            return x["keys"].index_select(0, slots[order]), x["values"].index_select(0, slots[order])

        every_us = kernel_us(lambda: attend(x, every, per_tile, args.max_len))  # noqa: B023
        decodes_us = kernel_us(lambda: attend(x, decodes, per_tile, args.max_len))  # noqa: B023
        gather_us, (keys, values) = kernel_us(gather), gather()
        keys_in = [b - a if bool(prompt[a]) else 0 for a, b in zip(bounds[:-1], bounds[1:])]  # fillers: none
        seg_k = [sum(keys_in[:i]) for i in range(len(keys_in) + 1)]
        for segments in (8, 17, 33):  # the list's fixed length (fresh prompts of >= 256 / 128 tokens in 2,048)
            cu_q, cu_k = (
                torch.tensor(s + [s[-1]] * (segments + 1 - len(s)), dtype=torch.int32, device=device)
                for s in (bounds, seg_k)
            )
            # (query, keys, values, segments' starts, keys' starts, longest segment, longest keys, dropout,
            # causal, debug mask): the aten op of PyTorch's flash varlen, the same in torch 2.11 and 2.13
            flash = functools.partial(
                torch.ops.aten._flash_attention_forward,
                *(x["q"], keys, values, cu_q, cu_k, bucket, bucket, 0.0, True, False),
                scale=DIM**-0.5,
            )
            out = flash()[0].reshape(bucket, -1)
            error = (out[prompt].float() - reference[prompt].float()).abs().max().item()
            flash_us = kernel_us(flash)
            rows_out.append(
                {
                    "layout (decode + prompts x tokens)": f"{kind}, bucket {bucket}",
                    "segments": segments,
                    "kernel, every tile µs": f"{every_us:.1f}",
                    "kernel, decode tiles µs": f"{decodes_us:.1f}",
                    "flash, prompts µs": f"{flash_us:.1f}",
                    "gather keys µs": f"{gather_us:.1f}",
                    "split: sum µs": f"{decodes_us + flash_us + gather_us:.1f}",
                    "max |diff|": f"{error:.1e}",
                }
            )
    title = f"a packed step's prompts: the kernel or flash, one layer, bf16, {describe_device()}"
    print_table(rows_out, title)


def decode_sweep(args) -> None:
    """A decode step's launch settings (module doc)."""
    device, dtype, module = "cuda", torch.bfloat16, decode_attention
    choose = module.split_count
    defaults = (module.DECODE_BLOCK_KEYS, module.DECODE_STAGES, None)  # None: split_count's splits
    variants = [defaults] + [(b, s, n) for b in (16, 32, 64) for s in (1, 2, 3) for n in (1, 2, 4, 8, 16)]
    every, best = [], []
    for kind in args.decode_layouts.split(","):
        x = step_inputs(kind, 8192, torch.Generator().manual_seed(0), device, dtype)
        tokens, reference, timings = len(x["positions"]), None, []
        kv_len = 1 << int(x["positions"].max()).bit_length()  # the engine's kv_lens bucket
        table = tile_table(x, 1, None)
        default_splits = f"{choose(kv_len, tokens * KV_HEADS, defaults[0])} (default)"
        for block_keys, stages, splits in variants:
            module.DECODE_BLOCK_KEYS, module.DECODE_STAGES = block_keys, stages
            module.split_count = choose if splits is None else (lambda *_, n=splits: n)
            try:
                out = attend(x, table, 1, kv_len)
                reference = out if reference is None else reference
                us = kernel_us(lambda: attend(x, table, 1, kv_len))  # noqa: B023
                error = (out.float() - reference.float()).abs().max().item()
            except Exception:  # a launch setting this GPU cannot run (shared memory, registers)
                us, error = float("nan"), float("nan")
            timings.append((us, block_keys, stages, splits or default_splits, error))
        module.DECODE_BLOCK_KEYS, module.DECODE_STAGES, module.split_count = defaults[0], defaults[1], choose
        layout = f"{tokens} tokens at ~{kind.split(':')[2]} cached, kv_len {kv_len}"
        for us, b, s, n, error in timings:
            every.append(
                {
                    "layout": layout,
                    "BLOCK_KEYS": b,
                    "stages": s,
                    "splits": n,
                    "µs": f"{us:.1f}",
                    "max |diff|": f"{error:.1e}",
                }
            )
        fastest = min((t for t in timings if t[0] == t[0]), key=lambda t: t[0])
        best.append(
            {
                "layout": layout,
                "default µs": f"{timings[0][0]:.1f} ({timings[0][3]})",
                "fastest µs": f"{fastest[0]:.1f}",
                "its BLOCK_KEYS, stages, splits": f"{fastest[1]}, {fastest[2]}, {fastest[3]}",
                "max |diff|": f"{fastest[4]:.1e}",
            }
        )
    title = f"decode-step attention, one layer, bf16, {describe_device()}"
    if args.out:
        with open(args.out, "w") as f, contextlib.redirect_stdout(f):
            print_table(every, title)
    print_table(best, title + ": the fastest launch setting of each layout")


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
    print_table(rows_out, f"paged attention launch settings, one layer, bf16, {describe_device()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-len", type=int, default=40960, help="the cache's row length (a captured step's kv_len)")
    parser.add_argument("--sweep", action="store_true", help="the kernel's launch settings (module doc)")
    parser.add_argument("--varlen", action="store_true", help="new prompts in PyTorch's flash attention (module doc)")
    parser.add_argument("--decode-sweep", action="store_true", help="a decode step's launch settings (module doc)")
    parser.add_argument(
        "--decode-layouts",
        default="decode:1:576,decode:1:4000,decode:16:576,decode:64:576,decode:64:4000,decode:256:576,decode:256:2000",
        help="with --decode-sweep: comma-separated decode:TOKENS:CACHED",
    )
    parser.add_argument("--out", help="with --decode-sweep: every variant's timing into this file")
    args = parser.parse_args()
    if args.decode_sweep:
        return decode_sweep(args)
    if args.sweep:
        return sweep(args)
    if args.varlen:
        return varlen(args)
    device, dtype = "cuda", torch.bfloat16
    per_tile = decode_attention.tile_tokens(HEADS // KV_HEADS)
    rows_out = []
    for kind in ("follower", "mixed"):
        x = step_inputs(kind, args.max_len, torch.Generator().manual_seed(0), device, dtype)
        tokens = len(x["positions"])
        used_keys = int(x["positions"].max()) + 1
        programs = -(-tokens // per_tile) * KV_HEADS
        few = programs < 64  # paged_attention splits the keys then

        def splits(kv_len: int, programs=programs) -> int:
            return decode_attention.split_count(kv_len, programs, decode_attention.BLOCK_KEYS)

        for table in ("exact", "padded"):
            for kv_len in sorted({used_keys, args.max_len}):
                tiles = tile_table(x, per_tile, None if table == "exact" else tokens)

                def run():
                    return attend(x, tiles, per_tile, kv_len)  # noqa: B023

                rows_out.append(
                    {
                        "layout": f"{kind}: {tokens} tokens, {tiles[3]} tiles",
                        "table entries": len(tiles[0]),
                        "kv_len (splits)": f"{kv_len} ({splits(kv_len) if few else 1})",
                        "µs a call": f"{kernel_us(run):.1f}",
                    }
                )
    print_table(rows_out, f"paged attention, one layer, bf16, {describe_device()}")


if __name__ == "__main__":
    main()
