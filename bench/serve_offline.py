"""Serving throughput offline: many prompts of random lengths through moemesh's `generate`
(scheduler, paged cache, chunked prefill beside decoding) beside transformers' continuous
batching (`generate_batch`), in one run, on one GPU; then how fast a prompt is prefilled, and
what a cached prefix saves.

    PYTHONPATH=. python3 bench/serve_offline.py                          # 6-layer Qwen3-30B-A3B shape, bf16
    PYTHONPATH=. python3 bench/serve_offline.py --layers 48 --prompts 256 --new-tokens 256
    PYTHONPATH=. python3 bench/serve_offline.py --config configs/tiny.toml --prompts 6 \\
        --prompt-lens 16,48 --new-tokens 4 --prefill-len 96 --prefix-len 32   # CPU: checks that it runs

Random weights, greedy, no early stop (every request makes --new-tokens tokens). Tables:
  offline     --prompts prompts of uniformly random lengths in --prompt-lens, each continued by
              --new-tokens: wall time and output tokens/s. moemesh runs the workload twice on one
              engine: "cold" includes compiling kernels and capturing CUDA graphs, "warm" is the
              steady state a server reaches (the figure to quote). With it: steps, preemptions,
              and the agreement of --check requests' tokens with each prompt generated alone
              (bf16: sequences batched differently round differently; a near-tie can flip).
              transformers: `generate_batch` (paged cache, continuous batching) of the same
              prompts, after a warm-up call, unless --no-transformers. With --batch-invariant
              the workload runs again on an engine in that mode (issue 50): its warm seconds
              against the default's, and its requests must equal each prompt alone, bit for bit.
  prefill     one --prefill-len prompt, and a batch of short prompts (--prefill-len tokens in all)
              in one packed step: milliseconds and tokens/s (the engine's step, after a warm-up).
  prefix      time to first token of a request whose first --prefix-len tokens another request
              just computed (prefix caching), against the first's; followers one at a time.

Sides run one after the other, each model freed before the next (the 48-layer model is 61 GB in
bf16). Nothing is written.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from bench.common import add_model_arguments, bench_model_config, print_table, sync, timed
from bench.e2e import free, transformers_model
from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import Chunk, DecodeEngine
from moemesh.inference.generate import generate
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import build


def workload(config, args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    low, high = args.prompt_lens
    lengths = torch.randint(low, high + 1, (args.prompts,), generator=generator).tolist()
    return [torch.randint(1, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def moemesh_model(config, device, dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in bf16 directly: the 48-layer model has no room for an fp32 copy
    try:
        return build(config, seed=0, device=device).eval()
    finally:
        torch.set_default_dtype(previous)


def run_scheduler(engine, tokenizer, prompts, params) -> tuple[float, Scheduler, list]:
    scheduler = Scheduler(engine, tokenizer, max_waiting=len(prompts))
    seconds, sequences = timed(lambda: ([scheduler.submit(p, params) for p in prompts], scheduler.run_until_idle())[0])
    return seconds, scheduler, sequences


def offline_rows(model, args, prompts, tokenizer) -> list[dict]:
    """The workload on the default engine; with --batch-invariant on one in that mode as well,
    its warm seconds against the default's."""
    rows = engine_offline_rows(model, args, prompts, tokenizer, "moemesh")
    if args.batch_invariant:
        graphs = {"on": True, "off": False}.get(args.invariant_graphs)  # auto: the engine's default
        mode = engine_offline_rows(
            model, args, prompts, tokenizer, "batch-invariant", batch_invariant=True, cuda_graphs=graphs
        )
        mode[1]["vs default"] = f"{float(mode[1]['seconds']) / float(rows[1]['seconds']):.2f}×"
        rows += mode
    return rows


def engine_offline_rows(model, args, prompts, tokenizer, side: str, **engine_options) -> list[dict]:
    params = SamplingParams(max_tokens=args.new_tokens)
    engine = make_engine(model, args, max(map(len, prompts)) + args.new_tokens + 1, **engine_options)
    warm_up_s = engine.warm_up()
    rows = []
    for name in (f"{side}, cold", f"{side}, warm"):
        seconds, scheduler, sequences = run_scheduler(engine, tokenizer, prompts, params)
        out = sum(len(s.token_ids) for s in sequences)
        rows.append(
            {
                "side": name,
                "prompts": len(prompts),
                "prompt tokens": sum(map(len, prompts)),
                "output tokens": out,
                "seconds": f"{seconds:.2f}",
                "output tok/s": f"{out / seconds:,.0f}",
                "steps": sum(scheduler.decode_batches.values()),
                "preemptions": scheduler.preemptions,
            }
        )
    rows[0]["seconds"] += f" (+{warm_up_s:.1f} s warm-up)"
    if args.check:
        checked = min(args.check, len(prompts))
        same_tokens = same_sequences = total = 0
        for prompt, sequence in zip(prompts[: args.check], sequences):
            alone = generate(engine, tokenizer, [prompt], params)[0].token_ids
            total += len(alone)
            same_tokens += next((i for i, (a, b) in enumerate(zip(alone, sequence.token_ids)) if a != b), len(alone))
            same_sequences += alone == sequence.token_ids
        rows[1]["same as alone"] = f"{same_sequences}/{checked} requests, {same_tokens / total:.0%} of tokens"
    rows[1]["blocks"] = f"{engine.cache.num_blocks} of {engine.block_size} ({engine.capacity:,} tokens)"
    del engine
    free()
    return rows


def make_engine(model, args, max_len: int, tokens: int | None = None, **options) -> DecodeEngine:
    """The offline table's engine sizes its cache from free memory, as `serve` does; the others
    hold `tokens` (sizing from memory again would count what the allocator still caches)."""
    return DecodeEngine(
        model,
        max_batch=args.max_batch,
        max_len=max_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        packed_graph_tokens=args.packed_graph_tokens,
        block_size=args.block_size,
        num_blocks=None if tokens is None else 2 + math.ceil(tokens / args.block_size) + args.max_batch,
        gpu_memory_fraction=args.gpu_memory_fraction,
        **options,
    )


def prefill_rows(model, args, config) -> list[dict]:
    """One long prompt, then --prefill-len tokens of short prompts, each in one packed step."""
    engine = make_engine(model, args, args.prefill_len + 1, tokens=2 * args.prefill_len)
    engine.max_num_batched_tokens = args.prefill_len
    generator = torch.Generator().manual_seed(1)
    rows = []
    short = max(1, min(args.short_len, args.prefill_len))
    for name, count, length in (
        ("one prompt", 1, args.prefill_len),
        ("short prompts", args.prefill_len // short, short),
    ):
        count = min(count, engine.max_batch)
        prompts = [torch.randint(1, config.vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
        held = []
        for row in range(count):
            blocks = engine.blocks.allocate(math.ceil(length / engine.block_size))
            engine.set_blocks(row, blocks)
            held += blocks
        chunks = [Chunk(row, prompt, 0) for row, prompt in enumerate(prompts)]
        engine.step(chunks)  # warm-up: compiles this step's kernels
        times = [timed(lambda: engine.step(chunks))[0] for _ in range(args.repeat)]
        engine.blocks.release(held)
        seconds = statistics.median(times)
        rows.append(
            {
                "prefill": f"{name}: {count} × {length}",
                "ms": f"{seconds * 1e3:.1f}",
                "tokens/s": f"{count * length / seconds:,.0f}",
            }
        )
    return rows  # the engine is freed by the caller's free()


def profile_rows(model, args, config) -> list[dict]:
    """One packed step profiled: wall, GPU busy, kernels, synchronisations, top kernels. Of
    --profile-step new tokens after a cached 1,024-token prefix (a prefix reuse follower's step),
    or, with --profile-prompts K, of K new prompts sharing those tokens beside
    --profile-decodes decoding sequences 640 tokens in (a loaded server's prefill round)."""
    import gzip
    import json
    import tempfile
    from pathlib import Path

    from bench.common import interval_length, merged, profiled_kernels

    new, prompts, decodes = args.profile_step, args.profile_prompts, args.profile_decodes
    prefix = 640 if prompts else 1024
    engine = make_engine(model, args, prefix + new + 1, tokens=2 * (prefix + new) + decodes * (prefix + 1))
    ids = torch.randint(1, config.vocab_size, (prefix + new,)).tolist()
    blocks = []

    def hold(row: int, entries: int) -> None:
        blocks.extend(held := engine.blocks.allocate(math.ceil(entries / engine.block_size)))
        engine.set_blocks(row, held)

    if not prompts:
        hold(0, prefix + new)
        engine.step([Chunk(0, ids[:prefix], 0, False)])
        chunk = [Chunk(0, ids[prefix:], prefix, True)]
        what = f"step of {new} tokens after {prefix} cached"
    else:
        length = new // prompts
        chunk = []
        for row in range(prompts):
            hold(row, length)
            chunk.append(Chunk(row, ids[row : row + length], 0, True))
        for row in range(prompts, prompts + decodes):  # the decoding sequences, their caches filled
            hold(row, prefix + 1)
            engine.step([Chunk(row, ids[:prefix], 0, False)])
            chunk.append(Chunk(row, [ids[row]], prefix, True))
        what = f"step of {prompts} prompts of {length} tokens and {decodes} decode tokens"
    for _ in range(3):
        engine.step(chunk)  # warm-up
    wall = statistics.median(timed(lambda: engine.step(chunk))[0] for _ in range(5))
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json.gz"
        kernels = profiled_kernels(lambda: engine.step(chunk), trace, host=True)
        events = json.loads(gzip.open(trace, "rt").read())["traceEvents"]
    runtime: dict[str, int] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in e["name"] or "Memcpy" in e["name"]):
            runtime[e["name"]] = runtime.get(e["name"], 0) + 1
    busy = interval_length(merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels]))
    by_name: dict[str, list[float]] = {}
    for k in kernels:
        entry = by_name.setdefault(k["name"][:70], [0.0, 0])
        entry[0] += k["dur"]
        entry[1] += 1
    if args.host_profile:  # where the host's time goes: Python's profiler over 10 steps
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        profiler.runcall(lambda: [engine.step(chunk) for _ in range(10)])
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.host_profile)
    engine.blocks.release(blocks)
    rows = [
        {
            "what": what,
            "wall ms": f"{wall * 1e3:.1f}",
            "GPU busy ms": f"{busy / 1e3:.1f}",
            "kernels": len(kernels),
            "syncs and copies": ", ".join(f"{n} ×{c}" for n, c in sorted(runtime.items())),
        }
    ]
    rows += [
        {"what": name, "GPU busy ms": f"{t / 1e3:.2f}", "kernels": c}
        for name, (t, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:24]
    ]
    return rows


def first_token(scheduler: Scheduler, request: list[int]) -> tuple[float, int]:
    """(seconds from submitting the request to its first token, its prompt tokens found cached)."""
    first, cached = [], scheduler.cached_tokens
    sync()
    start = time.perf_counter()
    scheduler.submit(request, SamplingParams(max_tokens=1), lambda s, text: first.append(time.perf_counter()))
    scheduler.run_until_idle()
    return first[0] - start, scheduler.cached_tokens - cached


def prefix_rows(model, args, config, tokenizer) -> list[dict]:
    """Time to first token (submit to the first sampled token, one scheduler throughout): a request
    of a new --prefix-len prefix and a 64-token suffix, then requests of the same prefix and other
    suffixes, one at a time; again with prefix caching off."""
    generator = torch.Generator().manual_seed(2)
    prefix = torch.randint(1, config.vocab_size, (args.prefix_len,), generator=generator).tolist()
    suffix = max(1, min(64, args.prefix_len // 4))
    rows = []
    for caching in (True, False):
        engine = make_engine(model, args, args.prefix_len + suffix + 2, tokens=8 * (args.prefix_len + suffix + 2))
        engine.blocks.prefix_caching = caching
        scheduler = Scheduler(engine, tokenizer, max_waiting=4)
        for _ in range(2):  # warm-up: the kernels of steps of both sizes (unrelated prompts)
            first_token(scheduler, torch.randint(1, config.vocab_size, (args.prefix_len + suffix,)).tolist())
            first_token(scheduler, torch.randint(1, config.vocab_size, (suffix,)).tolist())
        suffixes = [torch.randint(1, config.vocab_size, (suffix,), generator=generator) for _ in range(1 + args.repeat)]
        ttft = [first_token(scheduler, prefix + s.tolist()) for s in suffixes]
        followers = statistics.median(s for s, _ in ttft[1:])
        rows.append(
            {
                "prefix caching": "on" if caching else "off",
                "request": f"{args.prefix_len} shared + {suffix}",
                "first TTFT ms": f"{ttft[0][0] * 1e3:.1f}",
                "followers' TTFT ms (median)": f"{followers * 1e3:.1f}",
                "followers / first": f"{followers / ttft[0][0]:.0%}",
                "cached tokens per follower": ttft[-1][1],
            }
        )
        del engine, scheduler
        free()
    return rows


def transformers_rows(config, args, device, prompts) -> list[dict]:
    from transformers import GenerationConfig

    model, title = transformers_model(config, device)
    model.eval()
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:4], generation_config=generation, progress_bar=False)  # warm-up
        seconds, results = timed(
            lambda: model.generate_batch(inputs=prompts, generation_config=generation, progress_bar=False)
        )
    out = sum(len(r.generated_tokens) for r in results.values())
    return [
        {
            "side": f"{title}, generate_batch",
            "prompts": len(prompts),
            "prompt tokens": sum(map(len, prompts)),
            "output tokens": out,
            "seconds": f"{seconds:.2f}",
            "output tok/s": f"{out / seconds:,.0f}",
        }
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=6)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-lens", default="128,1024", help="lowest,highest prompt length")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--packed-graph-tokens", type=int, help="the engine's (default its own; 0: packed steps eager)")
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    parser.add_argument("--check", type=int, default=8, help="requests compared with their prompt generated alone")
    parser.add_argument(
        "--prefill-len", type=int, default=4096, help="tokens of the prefill table's steps (0: no table)"
    )
    parser.add_argument("--short-len", type=int, default=256, help="length of the prefill table's short prompts")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared prefix of the prefix table (0: no table)")
    parser.add_argument("--profile-step", type=int, default=0, help="profile a step of N tokens after a cached prefix")
    parser.add_argument(
        "--profile-prompts", type=int, default=0, help="with --profile-step: new prompts in the step (0: a follower)"
    )
    parser.add_argument("--profile-decodes", type=int, default=0, help="with --profile-prompts: decode tokens beside")
    parser.add_argument("--host-profile", type=int, default=0, help="with --profile-step: N costliest functions")
    parser.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True, help="the offline table")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions of the prefill and prefix tables")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="moemesh's weights (default bf16 on a GPU): float32 "
        "shows whether a disagreement with the prompt alone is bf16's rounding",
    )
    parser.add_argument(
        "--batch-invariant", action="store_true", help="the offline workload also in batch-invariant mode, its ratio"
    )
    parser.add_argument(
        "--invariant-graphs", choices=["auto", "on", "off"], default="auto", help="that engine's CUDA graphs"
    )
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-moemesh", action="store_true", help="transformers alone (a run of its own for 48 layers)")
    parser.add_argument("--transformers-prompts", type=int, help="transformers' prompts: the first N (default all)")
    args = parser.parse_args()
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    config = bench_model_config(args)
    longest = max(
        args.prompt_lens[1] + args.new_tokens + 1, args.prefill_len + 1, args.prefix_len + 66, 1026 + args.profile_step
    )
    config = config.replace(
        max_position_embeddings=max(config.max_position_embeddings, longest), output_router_logits=False
    )
    tokenizer = ByteTokenizer()  # never decodes real text here: the ids are random
    tokenizer.eos_id = None  # no early stop: every request makes --new-tokens tokens
    prompts = workload(config, args)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (timings are only a smoke check)"
    title = (
        f"{config.num_hidden_layers} layers, {str(dtype)[6:]}, greedy, {where}, torch {torch.__version__}, "
        f"max batch {args.max_batch}, {args.max_num_batched_tokens} tokens a step, blocks of {args.block_size}"
    )
    offline_title = (
        f"offline: {args.prompts} prompts of {args.prompt_lens[0]}-{args.prompt_lens[1]} tokens, "
        f"{args.new_tokens} new tokens each; {title}"
    )
    rows = []
    if not args.no_moemesh:
        model = moemesh_model(config, device, dtype)
        if args.offline:
            rows = offline_rows(model, args, prompts, tokenizer)
            print_table(rows, offline_title)  # printed at once: a later table may run out of time or memory
        if args.prefill_len:
            print_table(prefill_rows(model, args, config), f"prefill, one packed step; {title}")
            free()
        if args.prefix_len:
            print_table(prefix_rows(model, args, config, tokenizer), f"prefix reuse; {title}")
        if args.profile_step and device.type == "cuda":
            print_table(profile_rows(model, args, config), f"one packed step, profiled; {title}")
        del model
        free()
    if not args.no_transformers:
        sync()
        rows += transformers_rows(config, args, device, prompts[: args.transformers_prompts])
        print_table(rows, offline_title)


if __name__ == "__main__":
    main()
