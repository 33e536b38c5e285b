"""What preemption costs: the same requests through pools of fewer and fewer blocks, and what
the scheduler's choice, recomputation, computes again against what swapping would copy.

    PYTHONPATH=. python3 bench/preemption.py --config configs/tiny.toml        # CPU, fp32
    PYTHONPATH=. python3 bench/preemption.py --layers 48 --prompts 256 --prompt-lens 128,1024 \\
        --new-tokens 256 --max-batch 128 --max-num-batched-tokens 8192            # one GPU, bf16

When a running sequence needs a block and none is free, the scheduler preempts the youngest
running sequence: its blocks are released, and it waits at the front of the queue with its tokens
so far, to be computed again when it is admitted (inference/scheduler.py). Its full blocks keep
their keys in the prefix cache, freed last block first, so that what the others take first is its
tail: re-admitted, it finds the rest of its tokens cached and computes only what was taken. Swap
would copy every block of the sequence to the host and back instead (vLLM's V0 had both modes;
V1 recomputes only).

Each pool holds --pools × the blocks every request holds at its end (prompt + new tokens, all at
once: 1 never preempts with --max-batch ≥ --prompts). A table row: blocks, preemptions, the
tokens re-admitted sequences held (what a swap would copy out and back), of them found in the
prefix cache, the tokens recomputed, the run's time and what it took over the largest pool's
run, and whether every request's tokens equal the largest pool's. The time over the largest pool
need not be recomputation: a smaller pool also runs fewer sequences at once, which neither mode
changes. So beside it: what recomputing those tokens costs at this engine's prefill rate (the
same prompts prefilled alone, timed on the same engine), and on a GPU what swapping them costs at
least: copying their bytes to pinned host memory and back in one piece each way.

Random weights, greedy, no early stop. fp32 on a CPU: equal tokens are exact; bf16 on a GPU,
a batch's company rounds differently, so equality is reported, not required.
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.common import add_model_arguments, bench_model_config, median_ms, print_table, timed
from bench.serve_offline import moemesh_model, workload
from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler


def run(model, prompts: list[list[int]], args, num_blocks: int, max_len: int) -> tuple[dict, list[list[int]]]:
    """Every request through an engine of `num_blocks` blocks, warm (a first pass of other
    prompts compiles the kernels and captures the graphs): the scheduler's counters and seconds,
    each request's tokens, the cache's bytes a token, and the seconds a prompt token costs when
    the same engine prefills the prompts alone."""
    engine = DecodeEngine(
        model,
        max_batch=args.max_batch,
        max_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=num_blocks,
    )

    def salted(salt: int) -> list[list[int]]:  # other prompts: nothing of one pass is cached for another
        return [[(t + salt) % model.config.vocab_size or 1 for t in p] for p in prompts]

    _pass(engine, salted(1), args.new_tokens)  # warm-up: kernels compiled, graphs captured
    counters, outputs = _pass(engine, salted(0), args.new_tokens)
    counters["bytes a token"] = engine.cache.bytes_per_block() // args.block_size
    prefill, _ = _pass(engine, salted(2), 1)  # the prompts alone: what a token's recomputation costs
    counters["prefill s a token"] = prefill["seconds"] / prefill["admitted"]
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return counters, outputs


def _pass(engine: DecodeEngine, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    """Every prompt continued by `new_tokens` tokens: the scheduler's counters, the seconds, the tokens."""
    scheduler = Scheduler(engine, ByteTokenizer(), max_waiting=len(prompts))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)

    def all_requests():
        sequences = [scheduler.submit(p, params) for p in prompts]
        scheduler.run_until_idle()
        return sequences

    seconds, sequences = timed(all_requests)
    counters = {
        "preemptions": scheduler.preemptions,
        "admitted": scheduler.prompt_tokens,
        "cached": scheduler.cached_tokens,
        "seconds": seconds,
    }
    return counters, [s.token_ids for s in sequences]


def swap_ms(num_bytes: int, device: torch.device) -> float | None:
    """Milliseconds to copy `num_bytes` from the device to pinned host memory and back (timed on
    at most 1 GiB, scaled: the link's rate does not change past that size)."""
    if device.type != "cuda" or num_bytes == 0:
        return None
    size = min(num_bytes, 2**30)
    on_device = torch.empty(size, dtype=torch.uint8, device=device)
    on_host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    ms = median_ms(lambda: (on_host.copy_(on_device, non_blocking=True), on_device.copy_(on_host, non_blocking=True)))
    return ms * num_bytes / size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=6)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-lens", default="64,256", help="lowest,highest prompt length")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pools", default="1,0.5,0.25", help="pool sizes, as shares of what all requests hold")
    args = parser.parse_args()
    args.prompt_lens = tuple(int(n) for n in args.prompt_lens.split(","))
    pools = sorted((float(p) for p in args.pools.split(",")), reverse=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    model = moemesh_model(config, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    prompts = workload(config, args)
    max_len = max(map(len, prompts)) + args.new_tokens + 1
    need = sum(len(p) + args.new_tokens for p in prompts)
    need_blocks = sum(math.ceil((len(p) + args.new_tokens) / args.block_size) for p in prompts)
    rows, first = [], None
    for share in pools:  # + the null block
        blocks = max(math.ceil(share * need_blocks), math.ceil(max_len / args.block_size)) + 1
        counters, outputs = run(model, prompts, args, blocks, max_len)
        first = first or (counters, outputs)
        readmitted = counters["admitted"] - first[0]["admitted"]
        found = counters["cached"] - first[0]["cached"]
        swap_bytes = 2 * readmitted * counters["bytes a token"]
        swap = swap_ms(swap_bytes, device)
        rows.append(
            {
                "pool": f"{share:g} ({(blocks - 1) * args.block_size:,} tokens)",
                "preemptions": counters["preemptions"],
                "re-admitted tokens": f"{readmitted:,}",
                "found cached": f"{found:,}",
                "recomputed": f"{readmitted - found:,} ({(readmitted - found) / max(readmitted, 1):.0%})",
                "swap would copy": f"{swap_bytes / 2**20:,.1f} MiB",
                "seconds": f"{counters['seconds']:.2f}",
                "over the largest pool": f"{counters['seconds'] - first[0]['seconds']:+.2f} s",
                "recomputation, at the prefill rate": f"{(readmitted - found) * counters['prefill s a token']:.2f} s",
                "swap's copies alone": "" if swap is None else f"{swap / 1e3:.2f} s",
                "tokens equal the largest pool's": sum(a == b for a, b in zip(outputs, first[1])),
            }
        )
    title = (
        f"{args.prompts} prompts of {args.prompt_lens[0]}–{args.prompt_lens[1]} tokens ({need:,} tokens at their end), "
        f"{args.new_tokens} new each, {config.num_hidden_layers} layers, {device.type}"
    )
    print_table(rows, f"preemption by recomputation; {title}")


if __name__ == "__main__":
    main()
