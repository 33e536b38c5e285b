"""What one round of the server costs on the random-weight Qwen3-30B-A3B shape: decode tokens alone,
1-4 prompts alone, and the two mixed (60 decode tokens beside 1-4 prompts), each one engine step
as the scheduler makes it (CUDA graphs), median of --repeat, and of it the graph's own time on
the GPU (the rest is the host's: the step's inputs built, its tokens read); with the random
weights' routing and spread (bench/common.py). The kernels of one such step:
`bench/serve_offline.py --no-offline --profile-step 512 --profile-prompts 1 --profile-decodes 60`.

    PYTHONPATH=. python3 bench/round_cost.py --layers 48
    PYTHONPATH=. python3 bench/round_cost.py --layers 48 --selected-expert-rows 1024,20000
    PYTHONPATH=. python3 bench/round_cost.py --config configs/tiny.toml --prompt-len 32 --decode 4  # CPU
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bench.common import add_model_arguments, bench_model_config, print_table, spread_routing, timed
from bench.serve_offline import moemesh_model
from moemesh.inference.engine import Chunk, DecodeEngine
from moemesh.models import moe

BLOCK_SIZE = 16


def rounds(args) -> dict[str, tuple[int, int]]:
    """name -> (decode tokens, prompts)"""
    named = {f"{args.decode} decode tokens": (args.decode, 0)}
    for prompts in range(1, 5):
        some = f"{prompts} prompt{'s' * (prompts > 1)}"
        named[some] = (0, prompts)
        named[f"{args.decode} decode + {some}"] = (args.decode, prompts)
    return named


def measure(model, args) -> list[dict]:
    length, context, rows = args.prompt_len, args.context, args.decode + 4
    entries, tokens = max(length, context) + 1, args.decode + 4 * length  # a row's; the largest step's
    blocks = math.ceil(entries / BLOCK_SIZE)
    engine = DecodeEngine(
        model,
        max_batch=max(rows, 8),
        max_len=entries,
        max_num_batched_tokens=tokens,
        packed_graph_tokens=tokens,
        num_blocks=2 + rows * blocks,
        block_size=BLOCK_SIZE,
    )
    for row in range(rows):
        engine.set_blocks(row, engine.blocks.allocate(blocks))
    letters = torch.randint(97, 123, (4, length)).tolist()
    replays = graph_timer(engine)
    table = []
    for name, (decode, prompts) in rounds(args).items():
        chunks = [Chunk(row, [97 + row % 26], context) for row in range(decode)]
        chunks += [Chunk(args.decode + p, letters[p], 0) for p in range(prompts)]
        engine.step(chunks)  # compiles and captures
        replays.clear()
        ms = statistics.median(timed(lambda: engine.step(chunks))[0] for _ in range(args.repeat)) * 1e3  # noqa: B023
        row = {"round": name, "tokens": decode + prompts * length, "ms": f"{ms:.1f}"}
        if replays:
            gpu = statistics.median(start.elapsed_time(end) for start, end in replays)
            row |= {"graph's GPU ms": f"{gpu:.1f}", "host ms (GPU idle)": f"{ms - gpu:.2f}"}
        table.append(row)
    engine.close()
    return table


def graph_timer(engine: DecodeEngine) -> list:
    """The engine's CUDA graph replays from now on, each as CUDA events (start, end) into the list
    returned: a step's time on the GPU, apart from the host's work around it."""
    replays, replay = [], engine._replay

    def timed_replay(key, step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = replay(key, step)
        end.record()
        replays.append((start, end))
        return out

    if engine.cuda_graphs:
        engine._replay = timed_replay
    return replays


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode", type=int, default=60, help="decoding sequences in a round")
    parser.add_argument("--context", type=int, default=576, help="the decoding sequences' cached tokens")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument(
        "--selected-expert-rows",
        help="comma-separated (token, expert) pairs up to which MoE blocks read the chosen experts' weights once "
        "(models/moe.py's SELECTED_EXPERT_ROWS; beyond, the grouped GEMM), each a table",
    )
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    model = moemesh_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    limits = (
        [int(n) for n in args.selected_expert_rows.split(",")]
        if args.selected_expert_rows
        else [moe.SELECTED_EXPERT_ROWS]
    )
    rows = []
    for routing in ("random weights'", "spread"):
        if routing == "spread":
            spread_routing(model)
        for limit in limits:
            moe.SELECTED_EXPERT_ROWS = limit  # read when a step is captured: each engine anew
            rows += [{"routing": routing, "selected expert rows": limit, **row} for row in measure(model, args)]
    print_table(rows, f"one engine step, {config.num_hidden_layers} layers, prompts of {args.prompt_len} tokens")


if __name__ == "__main__":
    main()
