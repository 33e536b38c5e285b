"""The engine's decoding and serving throughput offline, one script in four modes:

    (none)        decode steps: moemesh's engine beside transformers' `generate` (below)
    --offline     many prompts through `generate` beside transformers' `generate_batch`, a prompt's
                  prefill, and what a cached prefix saves
    --round-cost  what one round of the server costs: decode tokens, prompts, and the two mixed
    --preemption  what preemption costs: the same requests through pools of fewer and fewer blocks

Each mode has options of its own (`bench/serve/decode.py --offline --help` lists them); --record
(decode steps and --offline) writes the headline figures to the results file (bench/harness.py).

Decode steps: moemesh's engine beside transformers' `generate`, in one run, on one GPU.

    PYTHONPATH=. python3 bench/serve/decode.py                      # 6-layer Qwen3-30B-A3B shape, bf16
    PYTHONPATH=. python3 bench/serve/decode.py --layers 48          # the full 48-layer shape
    PYTHONPATH=. python3 bench/serve/decode.py --config configs/tiny.toml --prompt-len 32 --new-tokens 8 \\
        --batches 1,4                                               # CPU: checks that the script runs

Quantized weights (--quantize fp8, mxfp4 or both): the same steps with the weights kept quantized
as a published checkpoint keeps them (fp8: every projection but the head and the expert banks,
block FP8 of 128 x 128 tiles; mxfp4: the expert banks, gpt-oss's layout), random N(0, 0.02)
weights quantized at build on the GPU, printed beside the bf16 rows of the same run (a model whose
bf16 weights do not fit says so in its row), with the weights' GiB. --shape picks gpt-oss-120b's
or -20b's shape (configs/gpt_oss_*.toml) or DeepSeek-V3's cut to --layers (its first three layers
dense), instead of Qwen3-30B-A3B's:

    PYTHONPATH=. python3 bench/serve/decode.py --layers 48 --batches 1,64 --no-transformers --prompt-len 128 \
        --variants 1 --quantize fp8
    PYTHONPATH=. python3 bench/serve/decode.py --shape gpt_oss_120b --batches 1,64 --no-transformers \
        --prompt-len 128 --variants 1 --quantize mxfp4          # its bf16 row: out of memory on one H200
    PYTHONPATH=. python3 bench/serve/decode.py --shape deepseek_v3 --layers 5 --batches 1,64 \
        --no-transformers --prompt-len 128 --variants 1 --quantize fp8

--gpt-fast DIR adds gpt-fast's compiled MoE model at the same shape, batch 1, bf16 and its int8
weight-only variant (bench/serve/gpt_fast.py; --gpt-fast-variants int8 for one of them: each
compiles for ~2.5 minutes).

Random weights, a random prompt of --prompt-len tokens per sequence, greedy, --new-tokens
tokens. For each batch size B, a decode step of B sequences in milliseconds, the prompts' cost
left out. moemesh: "ms/token" is a step as `generate` runs it (scheduler, engine with CUDA graphs,
device sampling, stops, text), timed after every prompt is prefilled; "engine ms/step" the
engine's step alone. (Timing whole `generate` calls and subtracting a 1-token call is too
unsteady at batch 64: the 64 prefills outweigh the steps.) Up to four variants (--variants): as
shipped; the MoE block's experts read per expert at every batch (PER_TOKEN_ROWS = 0); every MoE
block on the grouped GEMM (SELECTED_EXPERT_ROWS = 0); the projections of few rows by cuBLAS
rather than `ops/gemv.py` (gemv.MAX_ROWS = 0) — which say where the thresholds belong.
transformers: bf16, SDPA, grouped_mm experts where the version has them, its dynamic cache;
`generate` of 1 and of --new-tokens tokens for the B prompts, the difference over the steps
(its prefill is one batched forward, small beside its steps).
Also printed: the share of moemesh's tokens at batch B equal to batch 1's for the same prompt
(bf16 greedy: rows batched differently round differently, and a near-tie can flip). --agreement N
(with --quantize): N prompts' greedy tokens from the kept weights against the same weights
dequantized (`agreement_rows`), beside the kept weights run again and with only the weights
outside the expert banks dequantized (where a parting comes from). --profile-steps N instead of
timing: the GPU kernels of N decode steps at --profile-batch, by name, with --quantize each
format's table after bf16's. Under dependent launches (ops/backend.py) a kernel's time includes
its wait for the one before, so its share says where a step waits, not what the kernel costs;
"span" is the first kernel's start to the last one's end, a step's share of it.

Sides run one after the other, each model freed before the next (the 48-layer model is 61 GB in
bf16). Prints a table per model; nothing is written but --record's rows.

--batch-invariant (issue 50): the engine in batch-invariant mode (ops/invariant.py's kernels)
beside the default, and its claim checked in bf16:

    PYTHONPATH=. python3 bench/serve/decode.py --layers 48 --batch-invariant --batches 1,64

For each batch, the engine's decode step alone (ms/step, as "engine ms/step" above) as shipped,
in the mode (eager, its default) and in the mode with its steps as CUDA graphs, and the ratios.
Then the check, at the largest batch: that many prompts (a few sharing half of the first one's),
--check-tokens greedy tokens each with log-probabilities, in the mode through one scheduler —
prompts prefilled in chunks at odd split points, prefixes reused, a KV pool too small for all
(preemption) — and then: (1) --alone of them generated alone (batch
1, whole-prompt prefill, another block size): tokens and log-probabilities compared; (2) every
sequence scored by the trainer's forward (`completion_logprobs`, gradients on, in the mode, a few
sequences a forward): log-probabilities and the experts chosen at every position the engine
computed compared. Counts of what differs are printed (0 is the claim). Last, an RL training
step's model part for --score-batch of them (the trainer's forward with gradients and the backward
into the weights), as shipped and in the mode. --invariant-graphs runs the check's batched engine
with CUDA graphs. With --profile-steps instead of all that: the kernels of the mode's decode step;
with --score-only, the training step's model part alone (--score-batch random sequences of
--prompt-len + --check-tokens tokens), and with --profile-scoring also each way's kernels and host
operators (a step of a few thousand tokens is bound by its host).

Under torchrun, tensor parallelism over the ranks launched (issue 49):

    torchrun --nproc-per-node N bench/serve/decode.py --layers 48 --tensor-parallel --batches 1,64
    torchrun --nproc-per-node N bench/serve/decode.py --all-reduce

--tensor-parallel: the model built on meta, laid out for tp=N (with --layout ep: the experts split
over N ranks, everything else whole on each, as `serve --ep N`; with --layout tp-ep: heads and
vocabulary split, the experts whole, as `serve --tp N --ep N`) and materialised from the seed, the
engine made with the TP group; the engine's decode step alone (ms/step, as "engine ms/step" above,
and "overlapped": each step launched before the one before it is read, its tokens PREVIOUS, as the
scheduler's overlap runs them; and so with a row's block table sent before each step, as a loaded
server's rows grow into new blocks: it reaches the device through pinned memory, without waiting) for
each way of summing the model's all-reduces (--ways: NCCL; the peer buffer's one-shot; its two-shot;
as shipped, `comm.PEER_ALL_REDUCE`), with the collectives of a step counted (those inside the
captured graphs included) and whether its greedy tokens equal the first way's; beside it the step's
graph replayed back to back on every rank ("graph alone ms": the GPUs without the host's work
between steps) and, during the timed steps, each rank's GPU time in a step's graph and idle before
it (CUDA events around each replay). With N = 1 it gives the one-GPU row; with --profile-steps, rank
0's kernels of a step instead (under the first of --step-variants: plain-launch gives each kernel's
own time, where a dependent launch's includes its wait for the kernel before). --step-variants
shipped,before (or plain-launch, no-prefetch, unfused-adds, sums-apart, dot-gemv) also times the
step with the kernels launched plainly, the GEMV's weights read after its wait, the residual adds
apart from the norms, the all-reduces apart from the norms (ops/summed_norm.py), one row through the
GEMV's tl.dot (ops/gemv.py), or all five. Ceilings (timing only, wrong tokens): skip-topk (a fixed
routing), skip-rope (no rotary and cache-write kernel), skip-combine (no weighted sum of the pairs),
free-sums (no rank adds another's partial): what fusing that launch away could gain at most;
no-split runs attention's keys unsplit (no merge kernel).
--all-reduce: one all-reduce of bf16 [--all-reduce-sizes KB] in microseconds, 32 of them captured
in a CUDA graph and replayed, each way, with the largest difference from an fp32 sum and whether
every rank got the same bits; then the sum with the residual add and RMSNorm after it, as the
all-reduce and `add_rms_norm` against the one kernel of `ops/summed_norm.py` (checked bit for bit
against the fp32 sum rounded once, on every rank).

--offline: serving throughput offline: many prompts of random lengths through moemesh's
`generate` (scheduler, paged cache, chunked prefill beside decoding) beside transformers'
continuous batching (`generate_batch`), in one run, on one GPU; then how fast a prompt is
prefilled, and what a cached prefix saves.

    PYTHONPATH=. python3 bench/serve/decode.py --offline                 # 6-layer Qwen3-30B-A3B shape, bf16
    PYTHONPATH=. python3 bench/serve/decode.py --offline --layers 48 --prompts 256 --new-tokens 256
    PYTHONPATH=. python3 bench/serve/decode.py --offline --config configs/tiny.toml --prompts 6 \\
        --prompt-lens 16,48 --new-tokens 4 --prefill-len 96 --prefix-len 32   # CPU: checks that it runs

Random weights, greedy, no early stop (every request makes --new-tokens tokens). Tables:
  workload    (--no-workload: none) --prompts prompts of uniformly random lengths in --prompt-lens,
              each continued by --new-tokens: wall time and output tokens/s. moemesh runs the workload twice on one
              engine: "cold" includes compiling kernels and capturing CUDA graphs, "warm" is the
              steady state a server reaches (the figure to quote). With it: steps, preemptions,
              and the agreement of --check requests' tokens with each prompt generated alone
              (bf16: sequences batched differently round differently; a near-tie can flip).
              transformers: `generate_batch` (paged cache, continuous batching) of the same
              prompts, after a warm-up call, unless --no-transformers. With --batch-invariant
              the workload runs again on an engine in that mode (issue 50): its warm seconds
              against the default's, and its requests must equal each prompt alone, bit for bit.
              With --quantize fp8[,mxfp4] it runs again on the model with its weights kept in
              each format (as the decode steps' rows: random weights quantized at build), its
              warm tokens/s against bf16's (issue 73: 384 prompts of 64-1,536 tokens, 192 new:
              --layers 48 --prompts 384 --prompt-lens 64,1536 --new-tokens 192 --quantize fp8).
  prefill     one --prefill-len prompt, and a batch of short prompts (--prefill-len tokens in all)
              in one packed step: milliseconds and tokens/s (the engine's step, after a warm-up).
  prefix      time to first token of a request whose first --prefix-len tokens another request
              just computed (prefix caching), against the first's; followers one at a time.

Sides run one after the other, each model freed before the next (the 48-layer model is 61 GB in
bf16). Nothing is written but --record's rows.

--round-cost: what one round of the server costs on the random-weight Qwen3-30B-A3B shape: decode
tokens alone, 1-4 prompts alone, and the two mixed (60 decode tokens beside 1-4 prompts), each one
engine step as the scheduler makes it (CUDA graphs), median of --repeat, and of it the graph's own
time on the GPU (the rest is the host's: the step's inputs built, its tokens read); with the random
weights' routing and spread (bench/harness.py's `spread_routing`). The kernels of one such step:
`bench/serve/decode.py --offline --no-workload --profile-step 512 --profile-prompts 1 --profile-decodes 60`.

    PYTHONPATH=. python3 bench/serve/decode.py --round-cost --layers 48
    PYTHONPATH=. python3 bench/serve/decode.py --round-cost --layers 48 --selected-expert-rows 1024,20000
    PYTHONPATH=. python3 bench/serve/decode.py --round-cost --config configs/tiny.toml --prompt-len 32 \\
        --decode 4                                                                           # CPU

--preemption: what preemption costs: the same requests through pools of fewer and fewer blocks,
and what the scheduler's choice, recomputation, computes again against what swapping would copy.

    PYTHONPATH=. python3 bench/serve/decode.py --preemption --config configs/tiny.toml     # CPU, fp32
    PYTHONPATH=. python3 bench/serve/decode.py --preemption --layers 48 --prompts 256 --prompt-lens 128,1024 \\
        --new-tokens 256 --max-batch 128 --max-num-batched-tokens 8192                      # one GPU, bf16

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
import contextlib
import itertools
import math
import os
import statistics
import sys
import time
import types

import torch

from bench.harness import (
    add_model_arguments,
    add_modes,
    add_record_flag,
    bench_model_config,
    chosen_mode,
    describe_device,
    free,
    kernels_by_name,
    median_ms,
    model_at,
    moemesh_model,
    print_table,
    record,
    spread_routing,
    sync,
    tensor_parallel_model,
    timed,
    transformers_model,
)
from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import PREVIOUS, Chunk, DecodeEngine, Sampling
from moemesh.inference.generate import generate
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import build, moe
from moemesh.models.transformer import DecoderLayer
from moemesh.ops import backend, decode_attention, expert_gemv, gemv
from moemesh.ops import topk_softmax as topk_kernel
from moemesh.parallel import comm

MODES = {
    "--offline": "many prompts through `generate` beside transformers' generate_batch; prefill; prefix reuse",
    "--round-cost": "what one round of the server costs: decode tokens, prompts, the two mixed",
    "--preemption": "what preemption costs: the same requests through pools of fewer and fewer blocks",
}


def where(device: torch.device) -> str:
    """The device and versions for a table's title (on a CPU: that its timings only check the script)."""
    return describe_device(device) + ("" if device.type == "cuda" else " (CPU: timings are only a smoke check)")


# ---- decode steps (no mode) ----------------------------------------------------------------------------


def quantized_model(config, device, dtype, fmt: str) -> torch.nn.Module:
    """moemesh's model of `config` for inference with the weights a published `fmt` checkpoint
    quantizes kept quantized (bench/train/lora.py's `random_quantized_base`: random weights
    quantized on the device, a few experts at a time, never a whole bf16 bank), the rest from seed 0."""
    from bench.train.lora import random_quantized_base
    from moemesh.models.build import meta_model
    from moemesh.parallel.parallelize import materialize

    model = meta_model(config, dtype)
    model.requires_grad_(False)
    random_quantized_base(model, fmt, device, seed=0)
    return materialize(model, device, seed=0).eval()


def weight_gib(model) -> float:
    """The bytes of the model's weights, quantized ones at their codes and scales."""
    from moemesh.ops.quantized_weight import QuantizedWeight

    dense = sum(t.numel() * t.element_size() for t in {p.data_ptr(): p for p in model.parameters()}.values())
    kept = sum(w.nbytes for m in model.modules() for w in vars(m).values() if isinstance(w, QuantizedWeight))
    return (dense + kept) / 2**30


def moemesh_rows(config, args, device, dtype, prompts) -> tuple[list[dict], dict]:
    rows, first_row = [], {}
    for fmt in ["bf16", *args.quantize]:
        try:
            model = (
                moemesh_model(config, device, dtype) if fmt == "bf16" else quantized_model(config, device, dtype, fmt)
            )
        except torch.OutOfMemoryError:
            free()
            rows.append({"side": f"moemesh, {fmt}", "batch": "-", "ms/token": "out of memory", "_ms": math.inf})
            continue
        more, first = weights_rows(model, config, args, prompts, fmt)
        rows += more
        first_row = first_row or first
        if args.agreement and fmt != "bf16":
            rows += agreement_rows(model, args, prompts, fmt)
        del model
        free()
    return rows, first_row


def agreement_rows(model, args, prompts, fmt: str) -> list[dict]:
    """--agreement N: the greedy tokens of N prompts × --new-tokens, batched, from the weights
    kept in `fmt`, and then from the same weights dequantized in place (each QuantizedWeight
    replaced by `weight.to(weight.dtype)`, bf16 on a GPU: the model a dequantizing reader gives):
    the share of token positions that agree, and of prompts whose tokens all do. The two run
    other kernels on the same values (exact fp32 products in the quantized one-row paths, bf16
    tiles elsewhere, sums in another order), so a disagreement is a near-tie flipped, after which
    the two continuations part. Two rows more say where the parting comes from: the kept weights
    run again (the engine's own repeatability), and only the weights outside the expert banks
    dequantized (attention and the other projections; the banks still kept)."""
    from moemesh.models.moe import Experts
    from moemesh.ops.quantized_weight import QuantizedWeight

    tokenizer = ByteTokenizer()
    tokenizer.eos_id = None
    batch = prompts[: args.agreement]
    params = SamplingParams(max_tokens=args.new_tokens)

    def tokens() -> list[list[int]]:
        engine = DecodeEngine(model, max_batch=len(batch), max_len=args.prompt_len + args.new_tokens + 1)
        out = [s.token_ids for s in generate(engine, tokenizer, batch, params)]
        del engine
        free()
        return out

    def dequantize(which) -> None:
        for module in model.modules():
            for name, weight in list(vars(module).items()):
                if isinstance(weight, QuantizedWeight) and which(module):
                    delattr(module, name)
                    module.register_parameter(name, torch.nn.Parameter(weight.to(weight.dtype), requires_grad=False))

    def row(against: str, other: list[list[int]]) -> dict:
        same = sum(a == b for k, d in zip(kept, other) for a, b in zip(k, d))
        parted = [next((i for i, (a, b) in enumerate(zip(k, d)) if a != b), None) for k, d in zip(kept, other)]
        parted = sorted(i for i in parted if i is not None)
        print(  # where the continuations part: at 0, the prompts' prefill already differs
            f"agreement, {fmt}, {against}: first differing token of each parted prompt {parted}", flush=True
        )
        return {
            "side": f"moemesh, {fmt} against {against}",
            "batch": len(batch),
            "ms/token": "",
            "same tokens as batch 1": f"{same / sum(map(len, kept)):.1%} of tokens, "
            f"{sum(k == d for k, d in zip(kept, other))}/{len(batch)} prompts whole",
            "_ms": math.inf,
        }

    kept = tokens()
    rows = [row("itself run again", tokens())]
    dequantize(lambda module: not isinstance(module, Experts))
    rows.append(row("its weights but the expert banks dequantized", tokens()))
    dequantize(lambda module: True)
    return [row("the same weights dequantized", tokens()), *rows]


def weights_rows(model, config, args, prompts, fmt: str) -> tuple[list[dict], dict]:
    tokenizer = ByteTokenizer()  # never decodes real text here: the ids are random
    tokenizer.eos_id = None  # no early stop: every sequence makes --new-tokens tokens
    rows, first_row = [], {}
    gib = weight_gib(model)
    shipped = (moe.SELECTED_EXPERT_ROWS, moe.PER_TOKEN_ROWS, gemv.MAX_ROWS)
    variants = {
        "moemesh": shipped,
        "moemesh, experts per expert only": (shipped[0], 0, shipped[2]),
        "moemesh, grouped GEMM only": (0, 0, shipped[2]),
        "moemesh, cuBLAS projections": (*shipped[:2], 0),
    }
    for name, (moe.SELECTED_EXPERT_ROWS, moe.PER_TOKEN_ROWS, gemv.MAX_ROWS) in list(variants.items())[: args.variants]:
        for batch in args.batches:
            engine = DecodeEngine(model, max_batch=batch, max_len=args.prompt_len + args.new_tokens + 1)
            batch_prompts = prompts[:batch]

            # warm-up: tunes and compiles the kernels, captures the graphs
            generate(engine, tokenizer, batch_prompts, SamplingParams(max_tokens=args.new_tokens))
            step_ms, sequences = min(
                (scheduler_step_ms(engine, tokenizer, batch_prompts, args.new_tokens) for _ in range(2)),
                key=lambda timing: timing[0],
            )
            engine_ms = min(engine_step_ms(engine, batch_prompts, args.new_tokens - 1) for _ in range(2))
            tokens = sequences[0].token_ids
            if name == "moemesh":
                first_row[batch] = tokens
            rows.append(
                {
                    "side": name if fmt == "bf16" else f"{name}, {fmt}",
                    "weights GiB": f"{gib:.3g}",
                    "batch": batch,
                    "ms/token": f"{step_ms:.2f}",
                    "tokens/s": f"{batch * 1e3 / step_ms:,.0f}",
                    "engine ms/step": f"{engine_ms:.2f}",
                    "same tokens as batch 1": (
                        f"{sum(a == b for a, b in zip(tokens, first_row[1])) / len(tokens):.0%}"
                        if name == "moemesh" and 1 in first_row
                        else ""
                    ),
                    "_ms": step_ms,
                }
            )
            del engine
            free()
    moe.SELECTED_EXPERT_ROWS, moe.PER_TOKEN_ROWS, gemv.MAX_ROWS = shipped
    return rows, first_row


def scheduler_step_ms(engine: DecodeEngine, tokenizer, prompts: list[list[int]], new_tokens: int):
    """Milliseconds a decode step as `generate` runs it (scheduler, stops, text), the prompts'
    prefill left out: all prompts submitted, the rounds until every prompt is prefilled (the token
    budget may take several) and one decode step untimed, the rest timed until all have
    `new_tokens`. Returns it and the sequences."""
    scheduler = Scheduler(engine, tokenizer, max_waiting=len(prompts))
    sequences = [scheduler.submit(prompt, SamplingParams(max_tokens=new_tokens)) for prompt in prompts]
    while not all(s.token_ids for s in sequences):
        scheduler.step()
    scheduler.step()
    sync()
    start, steps = time.perf_counter(), 0
    while scheduler.step():
        steps += 1
    return (time.perf_counter() - start) / steps * 1e3, sequences


def engine_steps(engine: DecodeEngine, prompts: list[list[int]], overlapped: bool = False, tables: bool = False):
    """The engine alone, without the scheduler and the text: every row given the blocks of a
    whole sequence, the prompts prefilled (packed, within the token budget) and one decode step
    run (graphs captured); returns step(i), the (i+1)-th decode step of all rows (it reads the
    new tokens back, as the scheduler does), drain(), which reads the last step's, and the blocks
    to release. `overlapped`: as the scheduler's overlap runs them, each step launched with
    PREVIOUS tokens before the step before it is read; `tables`: a row's block table sent again
    before each step, as a loaded server's rows grow into new blocks (64 rows of blocks of 16:
    ~4 a step)."""
    sampling = Sampling()
    held = []
    for row in range(len(prompts)):
        held += engine.blocks.allocate(math.ceil(engine.max_len / engine.block_size))
        engine.set_blocks(row, held[-math.ceil(engine.max_len / engine.block_size) :])
    per_step = max(1, engine.max_num_batched_tokens // len(prompts[0]))
    tokens = []
    for first in range(0, len(prompts), per_step):
        rows = range(first, min(first + per_step, len(prompts)))
        tokens += engine.step([Chunk(row, prompts[row], 0, True, 0, sampling) for row in rows])

    launched = [None]

    def step(i: int) -> None:
        if not overlapped:
            tokens[:] = engine.step(
                [Chunk(row, [tokens[row]], len(p) + i, True, i + 1, sampling) for row, p in enumerate(prompts)]
            )
            return
        chunks = [Chunk(row, [PREVIOUS], len(p) + i, True, i + 1, sampling) for row, p in enumerate(prompts)]
        if tables:
            row = i % len(prompts)
            engine.set_blocks(row, engine.tables[row].tolist())
        previous, launched[0] = launched[0], engine.launch(chunks)
        if previous is not None:
            tokens[:] = previous.tokens()

    def drain() -> None:
        if launched[0] is not None:
            tokens[:] = launched[0].tokens()
            launched[0] = None

    step(0)
    drain()
    sync()
    return step, drain, held


def engine_step_ms(engine: DecodeEngine, prompts: list[list[int]], steps: int, overlapped=False, tables=False) -> float:
    """Milliseconds a decode step of all rows, the engine alone, over `steps` - 1 steps (the
    collectives counted from their start: `comm.calls`); `overlapped`, `tables`: see engine_steps."""
    step, drain, held = engine_steps(engine, prompts, overlapped, tables)
    comm.reset_counts()
    start = time.perf_counter()
    for i in range(1, steps):
        step(i)
    drain()
    elapsed = time.perf_counter() - start
    engine.blocks.release(held)
    return elapsed / (steps - 1) * 1e3


# --batch-invariant's engines: (name, batch_invariant, cuda_graphs; None: the engine's default).
INVARIANT_WAYS = [("default", False, None), ("batch-invariant, eager", True, False), ("batch-invariant", True, None)]


def batch_invariant_rows(config, args, device, dtype, prompts) -> tuple[list[dict], list[dict]]:
    """--batch-invariant: (the decode step's timing rows, the check's rows); see the docstring."""
    model = moemesh_model(config, device, dtype)
    timing = []
    for batch in args.batches:
        row = {"batch": batch}
        ways = INVARIANT_WAYS if device.type == "cuda" else INVARIANT_WAYS[:2]  # graphs: a GPU's
        for name, invariant, graphs in ways:
            engine = DecodeEngine(
                model,
                max_batch=batch,
                max_len=args.prompt_len + args.new_tokens + 1,
                batch_invariant=invariant,
                cuda_graphs=graphs,
            )
            engine_step_ms(engine, prompts[:batch], 3)  # warm-up: compiles (and tunes) the kernels, captures the graphs
            ms = min(engine_step_ms(engine, prompts[:batch], args.new_tokens - 1) for _ in range(2))
            row[f"{name} ms/step"] = f"{ms:.2f}"
            row[f"{name} tokens/s"] = f"{batch * 1e3 / ms:,.0f}"
            del engine
            free()
        for name, _, _ in ways[1:]:
            row[f"{name} / default"] = f"{float(row[f'{name} ms/step']) / float(row['default ms/step']):.2f}"
        timing.append(row)
        print_table(timing, "decode step, the engine alone: as shipped and in batch-invariant mode")
    return timing, invariant_check(model, args, prompts)


def invariant_check(model, args, prompts) -> list[dict]:
    """The check of --batch-invariant (see the docstring) -> its rows."""
    from moemesh.train.logprobs import completion_logprobs

    tokenizer = ByteTokenizer()
    tokenizer.eos_id = None  # every sequence makes --check-tokens tokens
    batch, half = max(args.batches), args.prompt_len // 2
    chosen = [list(p) for p in prompts[:batch]]
    for p in chosen[1:4]:  # prefixes to reuse
        p[:half] = chosen[0][:half]
    params = SamplingParams(max_tokens=args.check_tokens, temperature=0.0, logprobs=0)
    max_len = args.prompt_len + args.check_tokens + 1
    per_sequence = math.ceil(max_len / 16)
    start = time.perf_counter()
    engine = DecodeEngine(
        model,
        max_batch=batch,
        max_len=max_len,
        batch_invariant=True,
        cuda_graphs=args.invariant_graphs,  # eager by default: the routing is recorded then
        max_num_batched_tokens=args.prompt_len * 3 // 2 + 7,  # prompts cut at odd places
        num_blocks=max(per_sequence + 1, batch * per_sequence * 7 // 10),  # too few for all: preemption
    )
    # A graph's replay records no routing: with graphs, the log-probabilities alone are compared.
    scheduler = Scheduler(engine, tokenizer, max_waiting=batch, record_routing=not engine.cuda_graphs)
    together = [scheduler.submit(p, params) for p in chosen]
    scheduler.run_until_idle()
    if scheduler.routing is not None:
        scheduler.routing.stop()
    note = f"{scheduler.preemptions} preemptions, {scheduler.cached_tokens} prompt tokens from the prefix cache"
    print(f"together: batch {batch}, {time.perf_counter() - start:.0f} s, {note}", flush=True)
    del engine, scheduler
    free()

    def logprobs(sequence) -> torch.Tensor:
        return torch.tensor([p.logprob for p in sequence.logprobs])

    rows = []
    start = time.perf_counter()
    picked = sorted({0, 1, batch // 2, batch - 1})[: args.alone] if args.alone else []
    tokens = differ_tokens = differ_logprobs = 0
    for i in picked:
        engine = DecodeEngine(model, max_batch=1, max_len=max_len, batch_invariant=True, block_size=32)
        _, _, (alone,) = run_scheduler(engine, tokenizer, [chosen[i]], params)
        ours, theirs = alone.token_ids, together[i].token_ids
        same = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
        tokens += len(ours)
        differ_tokens += len(ours) - same
        differ_logprobs += int((logprobs(alone)[:same] != logprobs(together[i])[:same]).sum())  # where tokens agree
        del engine
        free()
    rows.append(
        {
            "comparison": f"batch {batch} (chunked, cached, preempted) vs alone, {len(picked)} sequences",
            "tokens compared": tokens,
            "tokens differing": f"{differ_tokens} (from the first that differs on)",
            "log-probs differing": differ_logprobs,
            "routing decisions compared": "",
            "routing differing": "",
            "seconds": f"{time.perf_counter() - start:.0f}",
        }
    )
    print_table(rows, "batch-invariant mode: bit-equality")

    start = time.perf_counter()
    compared = differing = decisions = routing_differing = 0
    largest = 0.0
    for first in range(0, batch, args.score_batch):
        group = together[first : first + args.score_batch]
        with torch.enable_grad():
            scored = completion_logprobs(
                model, [s.prompt_ids for s in group], [s.token_ids for s in group], 0.0, True, True
            )
        for j, sequence in enumerate(group):
            ours, theirs = scored.logprobs[j].detach().cpu(), logprobs(sequence)
            compared += len(theirs)
            differing += int((ours != theirs).sum())
            largest = max(largest, float((ours - theirs).abs().max()))
            for position, experts in sequence.routing.items():
                same = (experts.cpu() == scored.routing[j][position].cpu()).all(-1)
                decisions += same.numel()
                routing_differing += int((~same).sum())
        del scored
    print_table(scoring_rows(model, together[: args.score_batch], args), "the trainer's forward and backward")
    rows.append(
        {
            "comparison": f"engine (batch {batch}) vs the trainer's forward, {batch} sequences",
            "tokens compared": compared,
            "tokens differing": "",
            "log-probs differing": f"{differing} (largest {largest:.3g})",
            "routing decisions compared": decisions,
            "routing differing": routing_differing,
            "seconds": f"{time.perf_counter() - start:.0f}",
        }
    )
    return rows


def scoring_rows(model, sequences, args) -> list[dict]:
    """An RL training step's model part, as shipped and in the mode: `completion_logprobs` of
    `sequences` (forward with gradients) and the backward of their summed log-probabilities into
    the weights; ms (median of 5, the two ways in turn), tokens/s, and the mode's ratio."""
    from moemesh.train.logprobs import completion_logprobs

    def step(invariant: bool) -> None:
        with torch.enable_grad():
            scored = completion_logprobs(
                model, [s.prompt_ids for s in sequences], [s.token_ids for s in sequences], 0.0, False, invariant
            )
            torch.cat(list(scored.logprobs)).sum().backward()
        model.zero_grad(set_to_none=True)

    tokens = sum(len(s.prompt_ids) + len(s.token_ids) for s in sequences)
    row = {"sequences": len(sequences), "tokens": tokens}
    ways = (("default", False), ("batch-invariant", True))
    times = {name: [] for name, _ in ways}
    try:
        for _, invariant in ways:  # warm-up: compiles the kernels
            step(invariant)
        for _ in range(5):  # the two ways in turn, so that a drift of the host's load touches both
            for name, invariant in ways:
                times[name].append(median_ms(lambda invariant=invariant: step(invariant), warmup=0, repeat=1))
    except torch.OutOfMemoryError:
        row["default ms"] = "out of memory"
        model.zero_grad(set_to_none=True)
        free()
        return [row]
    for name, _ in ways:
        ms = statistics.median(times[name])
        row[f"{name} ms"] = f"{ms:.1f}"
        row[f"{name} tokens/s"] = f"{tokens * 1e3 / ms:,.0f}"
    row["batch-invariant / default"] = f"{float(row['batch-invariant ms']) / float(row['default ms']):.2f}"
    if args.profile_scoring and torch.cuda.is_available():  # where each way's step goes: its kernels, and their share
        from bench.harness import profiled_kernels

        for name, invariant in ways:
            start = time.perf_counter()
            kernels = profiled_kernels(lambda invariant=invariant: step(invariant))
            wall = (time.perf_counter() - start) * 1e3
            busy = sum(k["dur"] for k in kernels) / 1e3
            title = f"the scoring step's kernels, {name}: {busy:.1f} of {wall:.1f} ms busy"
            print_table(kernel_table(kernels, 1, name), title)
        for name, invariant in ways:
            host = host_table(lambda invariant=invariant: step(invariant))
            print_table(host, f"the scoring step's host side, {name}")
    return [row]


def host_table(fn) -> list[dict]:
    """fn() under the profiler, its host operators by their own time (self CPU), the busiest 30."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [
        {
            "operator": e.key[:70],
            "calls": e.count,
            "self ms": f"{e.self_cpu_time_total / 1e3:.1f}",
            "with children ms": f"{e.cpu_time_total / 1e3:.1f}",
        }
        for e in events[:30]
    ]


# The ways of `--ways`: comm.PEER_ALL_REDUCE's thresholds (bytes) for each; "shipped" keeps its own.
WAYS = {
    "nccl": {"one_shot": 0, "two_shot": 0},
    "one-shot": {"one_shot": 1 << 40, "two_shot": 0},
    "two-shot": {"one_shot": 0, "two_shot": 1 << 40},
    "shipped": dict(comm.PEER_ALL_REDUCE),
}


def tensor_parallel_rows(config, args, prompts) -> list[dict]:
    """The engine's decode step on all ranks launched, for each way of summing (rank 0's rows)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    model, group = tensor_parallel_model(config, args.layout)
    rows, first = [], {}
    if args.profile_steps:  # rank 0's kernels, as shipped or as the first --step-variants says
        step_variant(args.step_variants[0])
        engine = DecodeEngine(
            model, max_batch=args.profile_batch, max_len=args.prompt_len + args.profile_steps + 2, group=group
        )
        return led(engine, lambda e: kernel_rows(e, args, prompts)) or []
    shipped_rows = gemv.MAX_ROWS
    ways = args.ways if world > 1 else ["nccl"]
    for way, gemv.MAX_ROWS, variant in itertools.product(ways, args.gemv_rows, args.step_variants):
        comm.PEER_ALL_REDUCE.update(WAYS[way])
        step_variant(variant)
        for batch in args.batches:
            engine = DecodeEngine(model, max_batch=batch, max_len=args.prompt_len + args.new_tokens + 1, group=group)
            with replays_timed() as replays:
                row = led(engine, lambda e: tensor_parallel_row(e, args, prompts[:batch], world, way, first))
            gaps = gathered(replay_gaps(replays, batch))
            replayed = replay_ms(engine, batch)
            if row and len(args.step_variants) > 1:
                row["variant"] = variant
            if row:
                row["graph alone ms"] = f"{replayed:.2f}"
                row["in the graph / idle before it, ms, by rank"] = ", ".join(f"{a:.2f} / {b:.2f}" for a, b in gaps)
            rows += [row] if row else []
            del engine  # its KV cache took what the weights left: gone before the next engine sizes its own
            free()
    comm.PEER_ALL_REDUCE.update(WAYS["shipped"])
    gemv.MAX_ROWS = shipped_rows
    step_variant("shipped")
    if dist.is_initialized():
        dist.barrier()
    return rows


# --step-variants: the decode step as shipped, and with what made it faster turned off (issue 49):
# kernels launched plainly rather than as programmatic dependent launches (ops/backend.py); the
# GEMV's first weights read after its wait rather than before (ops/gemv.py); the residual adds
# apart from the norms (DecoderLayer.infer); the all-reduces apart from the norms, by the peer
# buffer's one-shot kernel (ops/summed_norm.py); one row through the GEMV's tl.dot, padded to 16,
# rather than its reduction (ops/gemv.py); attention's tiles and first keys read after its wait
# rather than before (ops/decode_attention.py); the per-token down projection's ids and first weights
# read after its wait (ops/expert_gemv.py); the router's choice as a maximum, then the index at it,
# in four warps (ops/topk_softmax.py); or all of them (the step before any).
STEP_VARIANTS = {
    "shipped": (),
    "plain-launch": ("dependent launch",),
    "no-prefetch": ("prefetch",),
    "unfused-adds": ("fused adds",),
    "sums-apart": ("sums in norms",),
    "dot-gemv": ("one-row reduction",),
    "late-reads": ("early reads",),
    "late-expert-weights": ("early expert weights",),
    "old-topk": ("packed choice",),
    "before": (
        "dependent launch",
        "prefetch",
        "fused adds",
        "sums in norms",
        "one-row reduction",
        "early reads",
        "early expert weights",
        "packed choice",
    ),
}


# --step-variants' ceilings (issue 49): a launch of each layer left out, to time what fusing it away
# could gain at most. Their tokens are wrong (the column "tokens as the first way" says no): the
# routing a fixed draw, the step's keys not written, the pairs not summed, or no rank's partial
# sums added to the others'. "no-split" is a real alternative: attention's keys unsplit, no merge.
CEILINGS = {
    "skip-topk": ("topk",),
    "skip-rope": ("rope",),
    "no-split": ("split",),
    "skip-combine": ("combine",),
    "free-sums": ("sums",),
}
STEP_VARIANTS.update(CEILINGS)
_SHIPPED = {}  # (module, attribute) -> what the ceilings replace there
_CEILING_TENSORS = {"routes": {}, "queries": {}}  # made once a shape, outside any graph


def fixed_routing(logits: torch.Tensor, k: int, normalise: bool):
    """skip-topk's routing: for each row count, one uniform draw of k distinct experts a token
    (made once, outside any graph) with weights 1/k."""
    key = (logits.shape[0], k, logits.device)
    if key not in _CEILING_TENSORS["routes"]:
        generator = torch.Generator().manual_seed(0)
        ids = torch.stack([torch.randperm(logits.shape[1], generator=generator)[:k] for _ in range(logits.shape[0])])
        weights = torch.full(ids.shape, 1 / k, dtype=torch.float32)
        _CEILING_TENSORS["routes"][key] = (weights.to(logits.device), ids.to(logits.device))
    return _CEILING_TENSORS["routes"][key]


def unwritten_queries(q: torch.Tensor, k, v, cos: torch.Tensor, *rest) -> torch.Tensor:
    """skip-rope's queries: zeros of the shape rope_to_cache gives (made once a shape, outside any
    graph); the cache not written."""
    shape = (q.shape[0], q.shape[1] // cos.shape[1], cos.shape[1])
    if (shape, q.device) not in _CEILING_TENSORS["queries"]:
        _CEILING_TENSORS["queries"][shape, q.device] = q.new_zeros(shape)
    return _CEILING_TENSORS["queries"][shape, q.device]


def step_variant(name: str) -> None:
    off = STEP_VARIANTS[name]
    backend.DEPENDENT_LAUNCH = "dependent launch" not in off
    gemv.PREFETCH_WEIGHTS = "prefetch" not in off
    DecoderLayer.fuses_residual_adds = "fused adds" not in off
    comm.SUMS_IN_NORMS = "sums in norms" not in off
    gemv.ONE_ROW_REDUCTION = "one-row reduction" not in off
    decode_attention.EARLY_READS = "early reads" not in off
    expert_gemv.EARLY_WEIGHTS = "early expert weights" not in off
    topk_kernel.PACKED_CHOICE = "packed choice" not in off
    patches = {
        "topk": (moe, "topk_softmax", fixed_routing),
        "rope": (decode_attention, "rope_to_cache", unwritten_queries),
        "split": (decode_attention, "split_count", lambda *args: 1),
        "combine": (moe, "combine_pairs", lambda out, ids, *rest: out.view(*ids.shape, -1)[:, 0]),
        "sums": (comm, "_sum_of", lambda x, group, phase: x),
    }
    for what, (module, attribute, ceiling) in patches.items():
        shipped = _SHIPPED.setdefault((module.__name__, attribute), getattr(module, attribute))
        setattr(module, attribute, ceiling if what in off else shipped)
    if "sums" in off:
        comm.SUMS_IN_NORMS = False  # the norm then adds what _sum_of returns: the rank's own partial


@contextlib.contextmanager
def replays_timed():
    """Inside, every CUDA graph replay of a DecodeEngine is bracketed by CUDA events: yields the
    list of (key, start, end) they go to."""
    shipped, replays = DecodeEngine._replay, []

    def timed(self, key, step):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = shipped(self, key, step)
        end.record()
        replays.append((key, start, end))
        return out

    DecodeEngine._replay = timed if torch.cuda.is_available() else shipped
    try:
        yield replays
    finally:
        DecodeEngine._replay = shipped


def replay_gaps(replays, batch: int) -> tuple[float, float]:
    """Of the decode steps of `batch` rows that followed one another: the median ms the GPU spent
    in a step's graph (waits for the other ranks included) and idle before it (the host's work
    between steps: reading the tokens back, the next step's message, sending it to the others)."""
    sync()
    inside, idle = [], []
    for (key0, _, end0), (key, start, end) in zip(replays, replays[1:]):
        if key[0] == batch and key0 == key:
            inside.append(start.elapsed_time(end))
            idle.append(end0.elapsed_time(start))
    return (statistics.median(inside), statistics.median(idle)) if inside else (float("nan"), float("nan"))


def gathered(value) -> list:
    """`value` of every rank, in rank order (this rank's alone without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def replay_ms(engine: DecodeEngine, batch: int, replays: int = 40) -> float:
    """Milliseconds a replay of the engine's last captured decode step of `batch` rows, replayed
    back to back on every rank at once (the host never waits): the GPUs' step without the host's
    work between steps (reading the tokens back, the next step's message, sending it)."""
    import torch.distributed as dist

    graphs = [g for key, (g, _, _) in engine.graphs.items() if key[0] == batch]
    if not graphs:  # eager (a CPU)
        return float("nan")
    graph = graphs[-1]
    if dist.is_initialized():
        dist.barrier()
    sync()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    sync()
    return (time.perf_counter() - start) / replays * 1e3


def led(engine: DecodeEngine, work):
    """`work(engine)` on the leader of the engine's group, which then releases the others; they
    follow its steps meanwhile. -> the leader's result, None on the others."""
    if not engine.leader:
        return engine.follow()
    try:
        return work(engine)
    finally:
        engine.close()


def tensor_parallel_row(engine: DecodeEngine, args, prompts: list[list[int]], world: int, way: str, first: dict):
    """The leader's timing of one engine, with the collectives of a step and the greedy tokens
    (against the first way's, in `first`)."""
    batch = len(prompts)
    timings, overlapped, tables = [], [], []
    for _ in range(2):
        timings.append(engine_step_ms(engine, prompts, args.new_tokens - 1))
        counted = {kind: n / (args.new_tokens - 2) for (kind, _), n in comm.calls.items()}
        overlapped.append(engine_step_ms(engine, prompts, args.new_tokens - 1, overlapped=True))
        tables.append(engine_step_ms(engine, prompts, args.new_tokens - 1, overlapped=True, tables=True))
    tokens = greedy_tokens(engine, prompts, args.new_tokens - 1)
    first.setdefault(batch, tokens)
    ms = min(timings)
    return {
        "GPUs": f"{world} ({args.layout.upper()})" if world > 1 else "1",
        "all-reduce": way if world > 1 else "",
        "gemv rows": gemv.MAX_ROWS,
        "batch": batch,
        "engine ms/step": f"{ms:.2f}",
        "overlapped ms/step": f"{min(overlapped):.2f}",
        "overlapped, a table sent each step, ms": f"{min(tables):.2f}",
        "tokens/s (overlapped)": f"{batch * 1e3 / min(overlapped):,.0f}",
        "all-reduces/step": f"{counted.get('all_reduce', 0):.0f}",
        "others/step": ", ".join(f"{k} {n:.0f}" for k, n in counted.items() if k != "all_reduce"),
        "tokens as the first way": "yes" if tokens == first[batch] else "no",
    }


def greedy_tokens(engine: DecodeEngine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's first greedy tokens, through the engine's decode steps."""
    step, _, held = engine_steps(engine, prompts)
    out = []
    for i in range(1, new_tokens):
        step(i)
        out.append(engine.last_logits.argmax(-1).tolist())
    engine.blocks.release(held)
    return out


def all_reduce_rows(args) -> list[dict]:
    """One all-reduce of each size, each way, as a CUDA graph of 32 replayed (rank 0's rows)."""
    import torch.distributed as dist

    from moemesh.parallel.mesh import ParallelDims, init_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = init_mesh(ParallelDims(tp=world)).group("tp")
    device = torch.device("cuda", torch.cuda.current_device())
    sizes = [int(float(s) * 1024) for s in args.all_reduce_sizes.split(",")]
    comm.use_peer_all_reduce(group, device, torch.bfloat16, max(sizes))
    rows = []
    for nbytes in sizes:
        generator = torch.Generator(device=device).manual_seed(dist.get_rank())
        x = torch.randn(nbytes // 2, generator=generator, device=device).bfloat16()
        exact = x.float()
        dist.all_reduce(exact, group=group)  # fp32
        row = {"GPUs": world, "KB": f"{nbytes / 1024:g}"}
        for way in args.ways:
            comm.PEER_ALL_REDUCE.update(WAYS[way])
            _, last, microseconds = graph_microseconds(lambda: comm.all_reduce_sum(x, group))
            gathered = [torch.empty_like(last) for _ in range(world)]
            dist.all_gather(gathered, last, group=group)
            same = all(torch.equal(g, gathered[0]) for g in gathered)
            error = (last.float() - exact).abs().max().item()
            row[f"{way} µs"] = f"{microseconds:.1f}"
            row[f"{way} err / same"] = f"{error:.2g} / {'yes' if same else 'NO'}"
        row.update(sum_in_norm_columns(x, exact, group))
        rows.append(row)
    comm.PEER_ALL_REDUCE.update(WAYS["shipped"])
    return rows


def graph_microseconds(work):
    """`work()` once eagerly (communicators made, kernels compiled), then 32 times captured in a
    CUDA graph, replayed 10 times -> (the eager result, the graph's last, µs a call)."""
    with torch.no_grad():
        first = work()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [work() for _ in range(32)]
    graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(10):
        graph.replay()
    sync()
    return first, outs[-1], (time.perf_counter() - start) / 320 * 1e6


def sum_in_norm_columns(x, exact, group) -> dict:
    """x [rows of 2048] summed over the ranks, added to a residual and normalised: the shipped
    all-reduce then `add_rms_norm` (two kernels) against `summed_norm`'s one kernel, each 32 times
    in a CUDA graph; and whether the kernel's result is, on every rank, `add_rms_norm` of the
    fp32 sum rounded once, bit for bit."""
    import torch.distributed as dist

    from moemesh.ops.rms_norm import add_rms_norm
    from moemesh.ops.summed_norm import summed_add_rms_norm_triton

    comm.PEER_ALL_REDUCE.update(WAYS["shipped"])
    peers = comm._peer_buffers[group].memory
    x = x.view(-1, 2048)
    if not peers.holds(x):  # more blocks of rows than the kernel has meetings for: the engine sums those apart
        return {}
    h = torch.randn(x.shape, generator=torch.Generator(device=x.device).manual_seed(7), device=x.device).to(x.dtype)
    weight = torch.rand(2048, device=x.device, dtype=x.dtype) + 0.5
    with torch.no_grad():
        want = add_rms_norm(h, exact.view_as(x).to(x.dtype), weight, 1e-6)
        _, _, apart = graph_microseconds(lambda: add_rms_norm(h, comm.all_reduce_sum(x, group), weight, 1e-6))
        out, _, fused = graph_microseconds(lambda: summed_add_rms_norm_triton(h, x, weight, 1e-6, peers))
    equal = torch.tensor([float(all(torch.equal(a, b) for a, b in zip(out, want)))], device=x.device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN, group=group)
    columns = {"all-reduce + add & norm µs": f"{apart:.1f}", "sum in the norm µs": f"{fused:.1f}"}
    columns["in the norm = fp32 sum's, every rank"] = "yes" if equal.item() == 1 else "NO"
    return columns


def profile_rows(config, args, device, prompts) -> list[dict]:
    """The GPU kernels of --profile-steps decode steps of the engine (in batch-invariant mode with
    --batch-invariant) at batch --profile-batch, by name: calls and microseconds per step, the
    busiest first (the kernels of the graphs' replays; the prompts' prefill not included). With
    --quantize, each format's table after bf16's (a model that does not fit: a row saying so)."""
    rows = []
    for fmt in ["bf16", *args.quantize]:
        try:
            if fmt == "bf16":
                model = build(config, seed=0, device=device).eval()
            else:
                model = quantized_model(config, device, torch.get_default_dtype(), fmt)
        except torch.OutOfMemoryError:
            free()
            rows.append({"kernel": f"{fmt}: out of memory"})
            continue
        max_len = args.prompt_len + args.profile_steps + 2
        engine = DecodeEngine(
            model, max_batch=args.profile_batch, max_len=max_len, batch_invariant=args.batch_invariant
        )
        rows += [{"weights": fmt, **row} for row in kernel_rows(engine, args, prompts)]
        del model, engine
        free()
    return rows


def kernel_rows(engine: DecodeEngine, args, prompts) -> list[dict]:
    """The kernels of --profile-steps decode steps of `engine` (this rank's), by name."""
    from bench.harness import profiled_kernels

    steps, batch = args.profile_steps, args.profile_batch
    step, _, _ = engine_steps(engine, prompts[:batch])
    return kernel_table(profiled_kernels(lambda: [step(i) for i in range(1, steps + 1)]), steps, f"batch {batch}")


def kernel_table(kernels: list[dict], steps: int, what: str) -> list[dict]:
    """Profiled kernels of `steps` steps, by name: calls and microseconds a step, the busiest first
    (30 rows, the first all of them)."""
    by_name = kernels_by_name(kernels)
    busy = sum(us for _, us, _ in by_name)
    span = max((k["ts"] + k["dur"] for k in kernels), default=0) - min((k["ts"] for k in kernels), default=0)
    rows = [
        {
            "kernel": name,
            "calls/step": f"{calls / steps:.1f}",
            "µs/step": f"{total / steps:.1f}",
            "share": f"{total / busy:.1%}",
        }
        for name, total, calls in by_name
    ]
    rows.insert(
        0,
        {
            "kernel": f"all kernels, {what}",
            "calls/step": f"{len(kernels) / steps:.0f}",
            "µs/step": f"{busy / steps:.0f}",
            "share": "100%",
            "span µs/step": f"{span / steps:.0f}" if kernels else "-",
        },
    )
    return rows[:30]


def transformers_rows(config, args, device, prompts) -> list[dict]:
    model, title = transformers_model(config, device)
    model.eval()
    rows = []
    for batch in args.batches:
        ids = torch.tensor(prompts[:batch], device=device)

        def run(n):
            with torch.no_grad():
                return model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

        run(args.new_tokens)
        one = min(timed(lambda: run(1))[0] for _ in range(2))
        many = min(timed(lambda: run(args.new_tokens))[0] for _ in range(2))
        step_ms = (many - one) / (args.new_tokens - 1) * 1e3
        rows.append(
            {
                "side": title,
                "batch": batch,
                "ms/token": f"{step_ms:.2f}",
                "tokens/s": f"{batch * 1e3 / step_ms:,.0f}",
                "engine ms/step": "",
                "same tokens as batch 1": "",
                "_ms": step_ms,
            }
        )
    return rows  # the model is freed here: transformers runs last


def decode_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, layers=6)
    parser.add_argument("--batches", default="1,4,16,64", help="comma-separated batch sizes")
    parser.add_argument(
        "--quantize",
        default="",
        help="comma-separated, of fp8 and mxfp4: rows with the weights kept quantized too, beside bf16's",
    )
    parser.add_argument(
        "--shape",
        choices=["qwen3_30b_a3b", *SHAPES],
        default="qwen3_30b_a3b",
        help="the model's shape, random weights (gpt-oss: configs/gpt_oss_*.toml, all its layers unless --layers "
        "is given; deepseek_v3: configs/deepseek_v3_671b.toml cut to --layers)",
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--agreement",
        type=int,
        default=0,
        metavar="N",
        help="with --quantize: N prompts' greedy tokens from the kept weights against the same weights "
        "dequantized (issue 73's check: 64 prompts x 64 tokens)",
    )
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--transformers-batches", help="transformers' batch sizes, if not those of --batches")
    parser.add_argument(
        "--gpt-fast",
        metavar="DIR",
        help="a gpt-fast checkout: its compiled MoE model (bf16 and int8 weight-only) at batch 1 beside "
        "moemesh's rows (bench/serve/gpt_fast.py)",
    )
    parser.add_argument(
        "--gpt-fast-variants", default="bf16,int8", help="which of gpt-fast's variants run (bf16, int8)"
    )
    parser.add_argument(
        "--variants",
        type=int,
        default=4,
        help="moemesh's variants to time, in this order: as shipped; experts read per expert at "
        "every batch; every MoE block on the grouped GEMM; the projections by cuBLAS",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="instead of timing: the GPU kernels of this many decode steps (with --quantize, each format's too)",
    )
    parser.add_argument("--profile-batch", type=int, default=1, help="the batch of --profile-steps")
    parser.add_argument(
        "--tensor-parallel", action="store_true", help="under torchrun: the engine's step over all ranks launched"
    )
    parser.add_argument(
        "--layout",
        choices=("tp", "ep", "tp-ep"),
        default="tp",
        help="with --tensor-parallel: split heads, expert slices and vocabulary (tp), the experts alone (ep: "
        "`serve --ep`, the rest whole on every rank), or heads and vocabulary with whole experts (tp-ep: "
        "`serve --tp N --ep N`)",
    )
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the engine's step in batch-invariant mode beside the default, and the mode's bit-equality checked",
    )
    parser.add_argument(
        "--invariant-graphs", action="store_true", help="--batch-invariant: the check's batched engine in CUDA graphs"
    )
    parser.add_argument("--check-tokens", type=int, default=160, help="--batch-invariant: new tokens a sequence")
    parser.add_argument("--alone", type=int, default=4, help="--batch-invariant: sequences generated alone too")
    parser.add_argument("--score-batch", type=int, default=4, help="--batch-invariant: sequences a trainer forward")
    parser.add_argument(
        "--score-only",
        action="store_true",
        help="--batch-invariant: only the training step's model part (--score-batch random sequences of --prompt-len + "
        "--check-tokens tokens), timed both ways",
    )
    parser.add_argument(
        "--profile-scoring", action="store_true", help="--score-only, and each way's kernels and host side profiled"
    )
    parser.add_argument("--all-reduce", action="store_true", help="under torchrun: the all-reduce alone, by size")
    parser.add_argument("--ways", default="nccl,one-shot,two-shot,shipped", help=f"of {', '.join(WAYS)}")
    parser.add_argument(
        "--gemv-rows",
        default=str(gemv.MAX_ROWS),
        help="with --tensor-parallel: comma-separated values of ops/gemv.py's MAX_ROWS to compare (the projections "
        "of up to that many rows by its kernel, more by cuBLAS)",
    )
    parser.add_argument(
        "--step-variants",
        default="shipped",
        help=f"with --tensor-parallel: comma-separated, of {', '.join(STEP_VARIANTS)} (what each turns off)",
    )
    parser.add_argument("--all-reduce-sizes", default="4,8,16,32,64,128,256,512,1024,4096", help="KB")
    add_record_flag(parser)


SHAPES = {"gpt_oss_120b": "gpt_oss_120b", "gpt_oss_20b": "gpt_oss_20b", "deepseek_v3": "deepseek_v3_671b"}


def shaped_config(args, parser: argparse.ArgumentParser):
    """--shape's model (--layers of it where given), else `bench_model_config`'s."""
    from moemesh.config import load_config

    if args.shape == "qwen3_30b_a3b" or args.config:
        return bench_model_config(args)
    config = load_config(f"configs/{SHAPES[args.shape]}.toml", launched=False).model
    layers = args.layers if "--layers" in sys.argv else None
    if args.shape == "deepseek_v3" and layers is None:
        parser.error("--shape deepseek_v3: give --layers (its cut; the first 3 are dense, 5 fit one H200 in bf16)")
    return config.replace(num_hidden_layers=layers or config.num_hidden_layers)


def decode(args, parser: argparse.ArgumentParser) -> None:
    args.quantize = [f for f in args.quantize.split(",") if f]
    if unknown := set(args.quantize) - {"fp8", "mxfp4"}:
        parser.error(f"--quantize: unknown {sorted(unknown)}; known: fp8, mxfp4")
    args.ways = args.ways.split(",")
    if unknown := set(args.ways) - set(WAYS):
        parser.error(f"--ways: unknown {sorted(unknown)}; known: {', '.join(WAYS)}")
    if args.new_tokens < 3:
        parser.error("--new-tokens must be at least 3 (the first two steps are not timed)")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.gemv_rows = [int(n) for n in args.gemv_rows.split(",")]
    args.step_variants = args.step_variants.split(",")
    if unknown := set(args.step_variants) - set(STEP_VARIANTS):
        parser.error(f"--step-variants: unknown {sorted(unknown)}; known: {', '.join(STEP_VARIANTS)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = shaped_config(args, parser)
    config = config.replace(
        max_position_embeddings=max(config.max_position_embeddings, args.prompt_len + args.new_tokens + 1),
        output_router_logits=False,
    )  # generation: no load-balancing loss on either side
    generator = torch.Generator().manual_seed(0)
    count = max(*args.batches, args.profile_batch, args.score_batch, args.agreement)
    prompts = torch.randint(1, config.vocab_size, (count, args.prompt_len), generator=generator).tolist()
    torch.manual_seed(0)
    title = (
        f"decode, {config.num_hidden_layers} layers, {str(dtype)[6:]}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, greedy, {where(device)}"
    )
    rank0 = os.environ.get("RANK", "0") == "0"
    if args.all_reduce:
        rows = all_reduce_rows(args)
        return print_table(rows, f"all-reduce of bf16, a CUDA graph of 32, {where(device)}") if rank0 else None
    if args.tensor_parallel:
        rows = tensor_parallel_rows(config, args, prompts)
        what = "kernels per decode step (rank 0)" if args.profile_steps else "tensor-parallel engine steps"
        return print_table(rows, f"{title}, {os.environ.get('WORLD_SIZE', '1')} GPUs: {what}") if rank0 else None
    if args.profile_steps:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        mode = " in batch-invariant mode" if args.batch_invariant else ""
        try:
            return print_table(profile_rows(config, args, device, prompts), f"{title}: kernels per decode step{mode}")
        finally:
            torch.set_default_dtype(previous)
    if args.batch_invariant and (args.profile_scoring or args.score_only):
        model = moemesh_model(config, device, dtype)
        completions = torch.randint(1, config.vocab_size, (args.score_batch, args.check_tokens), generator=generator)
        sequences = [types.SimpleNamespace(prompt_ids=p, token_ids=c) for p, c in zip(prompts, completions.tolist())]
        return print_table(scoring_rows(model, sequences, args), f"{title}: the trainer's forward and backward")
    if args.batch_invariant:
        timing, check = batch_invariant_rows(config, args, device, dtype, prompts)
        print_table(timing, f"{title}: the engine's decode step, as shipped and in batch-invariant mode")
        return print_table(check, f"{title}: batch-invariant mode, bit-equality (0 differing is the claim)")
    rows, _ = moemesh_rows(config, args, device, dtype, prompts)
    print_table(rows, title)  # printed at once: the other side may run out of time or memory
    if args.gpt_fast:
        from bench.serve.gpt_fast import gpt_fast_rows

        rows += gpt_fast_rows(config, args, device)
        print_table(rows, title)
    if not args.no_transformers:
        if args.transformers_batches:
            args.batches = [int(b) for b in args.transformers_batches.split(",")]
        rows += transformers_rows(config, args, device, prompts)
        print_table(rows, title)
    if args.record:
        record_decode(args, rows)


def record_decode(args, rows: list[dict]) -> None:
    """--record: moemesh's ms/token and tokens/s at each batch (as shipped), beside transformers'
    where it ran at that batch; with --quantize each format's beside bf16's."""
    theirs = {row["batch"]: row["_ms"] for row in rows if row["side"].startswith("transformers")}
    gpt_fast = {  # bench/serve/gpt_fast.py's rows (batch 1): its bf16 beside ours, its int8 beside the kept weights
        "int8" if "int8" in row["side"] else "bf16": row["_ms"]
        for row in rows
        if row["side"].startswith("gpt-fast") and math.isfinite(row["_ms"])
    }
    dense = {row["batch"]: row["_ms"] for row in rows if row["side"] == "moemesh"}
    shape = model_at(args) if args.shape == "qwen3_30b_a3b" else {"model": args.shape.replace("_", "-")}
    for row in rows:
        if not row["side"].startswith("moemesh") or not math.isfinite(row.get("_ms", math.inf)):
            continue  # (out of memory, or the agreement row)
        batch = row["batch"]
        if row["side"] == "moemesh":
            peer = theirs.get(batch)
            at, name = {**shape, "batch": batch}, "" if peer is None else "transformers"
        else:  # "moemesh, fp8": the weights kept quantized
            peer = dense.get(batch)  # (None where bf16's weights do not fit: no peer)
            at = {**shape, "batch": batch, "base": row["side"].split(", ")[1]}
            name = "" if peer is None else "moemesh bf16"
        record("decode ms/token", at, row["_ms"], "ms", name, peer)
        record("decode tokens/s", at, batch * 1e3 / row["_ms"], "tokens/s", name, peer and batch * 1e3 / peer)
        theirs_here = gpt_fast.get("bf16" if row["side"] == "moemesh" else "int8") if batch == 1 else None
        if theirs_here is not None:
            name = "gpt-fast compiled" + ("" if row["side"] == "moemesh" else " int8")
            record("decode ms/token", at, row["_ms"], "ms", name, theirs_here)


# ---- --offline -------------------------------------------------------------------------------------------


def workload(config, args) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    low, high = args.prompt_lens
    lengths = torch.randint(low, high + 1, (args.prompts,), generator=generator).tolist()
    return [torch.randint(1, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def run_scheduler(engine, tokenizer, prompts, params) -> tuple[float, Scheduler, list]:
    """The prompts through a scheduler of `engine`, all submitted at once: (seconds, the scheduler,
    the sequences)."""
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


def quantized_offline_rows(config, args, device, dtype, prompts, tokenizer, dense: list[dict]) -> list[dict]:
    """--quantize: the workload on models whose weights are kept in each format (`quantized_model`:
    random weights quantized at build), each warm run's tokens/s against bf16's (`dense`)."""
    rows = []
    for fmt in args.quantize:
        try:
            model = quantized_model(config, device, dtype, fmt)
        except torch.OutOfMemoryError:
            free()
            rows.append({"side": f"moemesh {fmt}", "seconds": "out of memory"})
            continue
        more = engine_offline_rows(model, args, prompts, tokenizer, f"moemesh {fmt}")
        if dense and "_tps" in dense[1]:
            more[1]["vs bf16"] = f"{more[1]['_tps'] / dense[1]['_tps']:.2f}×"
        rows += more
        del model
        free()
    return rows


def workload_row(side: str, prompts: list[list[int]], out: int, seconds: float) -> dict:
    """The workload table's row of one side's run: `out` tokens made in `seconds`."""
    return {
        "side": side,
        "prompts": len(prompts),
        "prompt tokens": sum(map(len, prompts)),
        "output tokens": out,
        "seconds": f"{seconds:.2f}",
        "output tok/s": f"{out / seconds:,.0f}",
        "_tps": out / seconds,
    }


def engine_offline_rows(model, args, prompts, tokenizer, side: str, **engine_options) -> list[dict]:
    params = SamplingParams(max_tokens=args.new_tokens)
    engine = make_engine(model, args, max(map(len, prompts)) + args.new_tokens + 1, **engine_options)
    warm_up_s = engine.warm_up()
    rows = []
    for name in (f"{side}, cold", f"{side}, warm"):
        seconds, scheduler, sequences = run_scheduler(engine, tokenizer, prompts, params)
        out = sum(len(s.token_ids) for s in sequences)
        rows.append(
            workload_row(name, prompts, out, seconds)
            | {"steps": sum(scheduler.decode_batches.values()), "preemptions": scheduler.preemptions}
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
                "_at": {"prompt": length, "prompts": count},
                "_tps": count * length / seconds,
            }
        )
    return rows  # the engine is freed by the caller's free()


def packed_profile_rows(model, args, config) -> list[dict]:
    """One packed step profiled: wall, GPU busy, kernels, synchronisations, top kernels. Of
    --profile-step new tokens after a cached 1,024-token prefix (a prefix reuse follower's step),
    or, with --profile-prompts K, of K new prompts sharing those tokens beside
    --profile-decodes decoding sequences 640 tokens in (a loaded server's prefill round)."""
    import gzip
    import json
    import tempfile
    from pathlib import Path

    from bench.harness import busy_intervals, interval_length, profiled_kernels

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
    busy = interval_length(busy_intervals(kernels))
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
        {"what": name, "GPU busy ms": f"{t / 1e3:.2f}", "kernels": c} for name, t, c in kernels_by_name(kernels)[:24]
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
                "_at": {"prefix": args.prefix_len, "suffix": suffix},
                "_ms": (followers * 1e3, ttft[0][0] * 1e3),
            }
        )
        del engine, scheduler
        free()
    return rows


def generate_batch_rows(config, args, device, prompts) -> list[dict]:
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
    return [workload_row(f"{title}, generate_batch", prompts, out, seconds)]


def workload_arguments(
    parser: argparse.ArgumentParser, prompts: int, lengths: str, new_tokens: int, max_batch: int, step_tokens: int
) -> None:
    """The options of a workload of random prompts (`workload`) and of its engine, with these defaults."""
    add_model_arguments(parser, layers=6)
    parser.add_argument("--prompts", type=int, default=prompts)
    parser.add_argument("--prompt-lens", default=lengths, help="lowest,highest prompt length")
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--max-batch", type=int, default=max_batch)
    parser.add_argument("--max-num-batched-tokens", type=int, default=step_tokens)
    parser.add_argument("--block-size", type=int, default=16)


def offline_arguments(parser: argparse.ArgumentParser) -> None:
    workload_arguments(parser, prompts=64, lengths="128,1024", new_tokens=128, max_batch=128, step_tokens=8192)
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
    parser.add_argument(
        "--workload", action=argparse.BooleanOptionalAction, default=True, help="the offline workload's table"
    )
    parser.add_argument("--no-offline", dest="workload", action="store_false", help="--no-workload's older name")
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
        "--quantize",
        default="",
        help="comma-separated, of fp8 and mxfp4: the offline workload also with the weights kept quantized (as the "
        "decode steps' rows), its ratio to bf16's",
    )
    parser.add_argument(
        "--invariant-graphs", choices=["auto", "on", "off"], default="auto", help="that engine's CUDA graphs"
    )
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--no-moemesh", action="store_true", help="transformers alone (a run of its own for 48 layers)")
    parser.add_argument("--transformers-prompts", type=int, help="transformers' prompts: the first N (default all)")
    add_record_flag(parser)


def offline(args, parser: argparse.ArgumentParser) -> None:
    args.prompt_lens = [int(n) for n in args.prompt_lens.split(",")]
    args.quantize = [f for f in args.quantize.split(",") if f]
    if unknown := set(args.quantize) - {"fp8", "mxfp4"}:
        parser.error(f"--quantize: unknown {sorted(unknown)}; known: fp8, mxfp4")
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
    title = (
        f"{config.num_hidden_layers} layers, {str(dtype)[6:]}, greedy, {where(device)}, "
        f"max batch {args.max_batch}, {args.max_num_batched_tokens} tokens a step, blocks of {args.block_size}"
    )
    offline_title = (
        f"offline: {args.prompts} prompts of {args.prompt_lens[0]}-{args.prompt_lens[1]} tokens, "
        f"{args.new_tokens} new tokens each; {title}"
    )
    rows, prefill, prefix = [], [], []
    if not args.no_moemesh:
        model = moemesh_model(config, device, dtype)
        if args.workload:
            rows = offline_rows(model, args, prompts, tokenizer)
            print_table(rows, offline_title)  # printed at once: a later table may run out of time or memory
        if args.prefill_len:
            prefill = prefill_rows(model, args, config)
            print_table(prefill, f"prefill, one packed step; {title}")
            free()
        if args.prefix_len:
            prefix = prefix_rows(model, args, config, tokenizer)
            print_table(prefix, f"prefix reuse; {title}")
        if args.profile_step and device.type == "cuda":
            print_table(packed_profile_rows(model, args, config), f"one packed step, profiled; {title}")
        del model
        free()
        if args.workload:
            rows += quantized_offline_rows(config, args, device, dtype, prompts, tokenizer, rows)
            print_table(rows, offline_title)
    if not args.no_transformers:
        sync()
        rows += generate_batch_rows(config, args, device, prompts[: args.transformers_prompts])
        print_table(rows, offline_title)
    if args.record:
        record_offline(args, rows, prefill, prefix)


def record_offline(args, rows: list[dict], prefill: list[dict], prefix: list[dict]) -> None:
    """--record: the workload's warm output tokens/s beside transformers' generate_batch (where it
    ran), the prefill table's tokens/s and the prefix-cached first token's time."""
    model = model_at(args)
    peer = next((row["_tps"] for row in rows if row["side"].startswith("transformers")), None)
    name = "" if peer is None else "transformers generate_batch"
    for row in rows:
        side, warm = row["side"].rsplit(", ", 1) if ", " in row["side"] else (row["side"], "")
        if warm != "warm":
            continue
        at = {**model, "prompts": row["prompts"]}
        if side == "moemesh":
            record("offline tokens/s", at, row["_tps"], "tokens/s", name, peer)
        elif side.startswith("moemesh "):  # the weights kept quantized, beside bf16's
            dense = next((r["_tps"] for r in rows if r["side"] == "moemesh, warm"), None)
            record("offline tokens/s", {**at, "base": side.split()[1]}, row["_tps"], "tokens/s", "moemesh bf16", dense)
        else:  # the engine in batch-invariant mode
            record("offline tokens/s", {**at, "mode": side}, row["_tps"], "tokens/s")
    for row in prefill:
        record("prefill tokens/s", {**model, **row["_at"]}, row["_tps"], "tokens/s")
    for row in prefix[:1]:  # prefix caching on
        followers, first = row["_ms"]
        record("prefix-cached TTFT ms", {**model, **row["_at"]}, followers, "ms", "first request (uncached)", first)


# ---- --round-cost ------------------------------------------------------------------------------------------


BLOCK_SIZE = 16


def rounds(args) -> dict[str, tuple[int, int]]:
    """name -> (decode tokens, prompts)"""
    named = {f"{args.decode} decode tokens": (args.decode, 0)}
    for prompts in range(1, 5):
        some = f"{prompts} prompt{'s' * (prompts > 1)}"
        named[some] = (0, prompts)
        named[f"{args.decode} decode + {some}"] = (args.decode, prompts)
    return named


def round_rows(model, args) -> list[dict]:
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
    table = []
    for name, (decode, prompts) in rounds(args).items():
        chunks = [Chunk(row, [97 + row % 26], context) for row in range(decode)]
        chunks += [Chunk(args.decode + p, letters[p], 0) for p in range(prompts)]
        with replays_timed() as replays:
            engine.step(chunks)  # compiles and captures
            replays.clear()
            ms = statistics.median(timed(lambda: engine.step(chunks))[0] for _ in range(args.repeat)) * 1e3
        row = {"round": name, "tokens": decode + prompts * length, "ms": f"{ms:.1f}"}
        if replays:
            gpu = statistics.median(start.elapsed_time(end) for _, start, end in replays)
            row |= {"graph's GPU ms": f"{gpu:.1f}", "host ms (GPU idle)": f"{ms - gpu:.2f}"}
        table.append(row)
    engine.close()
    return table


def round_cost_arguments(parser: argparse.ArgumentParser) -> None:
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


def round_cost(args, parser: argparse.ArgumentParser) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    model = moemesh_model(config, device)
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
            rows += [{"routing": routing, "selected expert rows": limit, **row} for row in round_rows(model, args)]
    print_table(rows, f"one engine step, {config.num_hidden_layers} layers, prompts of {args.prompt_len} tokens")


# ---- --preemption ------------------------------------------------------------------------------------------


def pool_run(model, prompts: list[list[int]], args, num_blocks: int, max_len: int) -> tuple[dict, list[list[int]]]:
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
    free()
    return counters, outputs


def _pass(engine: DecodeEngine, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list[list[int]]]:
    """Every prompt continued by `new_tokens` tokens: the scheduler's counters, the seconds, the tokens."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    seconds, scheduler, sequences = run_scheduler(engine, ByteTokenizer(), prompts, params)
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


def preemption_arguments(parser: argparse.ArgumentParser) -> None:
    workload_arguments(parser, prompts=32, lengths="64,256", new_tokens=64, max_batch=32, step_tokens=1024)
    parser.add_argument("--pools", default="1,0.5,0.25", help="pool sizes, as shares of what all requests hold")


def preemption(args, parser: argparse.ArgumentParser) -> None:
    args.prompt_lens = tuple(int(n) for n in args.prompt_lens.split(","))
    pools = sorted((float(p) for p in args.pools.split(",")), reverse=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    model = moemesh_model(config, device)
    prompts = workload(config, args)
    max_len = max(map(len, prompts)) + args.new_tokens + 1
    need = sum(len(p) + args.new_tokens for p in prompts)
    need_blocks = sum(math.ceil((len(p) + args.new_tokens) / args.block_size) for p in prompts)
    rows, first = [], None
    for share in pools:  # + the null block
        blocks = max(math.ceil(share * need_blocks), math.ceil(max_len / args.block_size)) + 1
        counters, outputs = pool_run(model, prompts, args, blocks, max_len)
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


def main(argv: list[str] | None = None) -> None:
    from moemesh.cli import inference_allocator

    inference_allocator()  # as `moemesh generate` and `serve` run (gpt-oss-120b's batch 64 needs it)
    argv = sys.argv[1:] if argv is None else argv
    mode = chosen_mode(argv, MODES)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments, run = {
        None: (decode_arguments, decode),
        "--offline": (offline_arguments, offline),
        "--round-cost": (round_cost_arguments, round_cost),
        "--preemption": (preemption_arguments, preemption),
    }[mode]
    arguments(parser)
    add_modes(parser, MODES)
    run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    main()
