"""The training step — forward, backward, gradient clipping to norm 1 (as transformers' Trainer does
by default and `moemesh train` does), AdamW step, zero_grad — under a layout: on one GPU against
transformers' own Qwen3-MoE, over several GPUs as assembled here (--layout), and through the
trainer's own step (`Trainer.train_step`) under named layouts (--trainer), lists of axis sizes
(--layouts) or FSDP's variants (--fsdp).

    PYTHONPATH=. python3 bench/train/step.py [--layers 6] [--seq 4096] [--batch 4] [--moemesh-fp32-master] \\
        [--recompute full] [--packed 512]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --layout ep [--single-gpu-baseline TOKENS_PER_S]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --layout dp_shard [--single-gpu-baseline TOKENS_PER_S]
    PYTHONPATH=. python3 bench/train/step.py --config configs/tiny.toml --seq 128 --batch 2 --steps 2 --warmup 1 \\
        (CPU smoke)

Model: Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8, expert width 768, 32/4 heads of 128,
vocabulary 151,936, untied embeddings) cut to --layers layers, or the [model] of a run config
(--config). Data: --batch random sequences of --seq tokens per GPU (fixed seed), labels = inputs.

Variants on one GPU (transformers first, each freed before the next so peaks are separate):
  transformers: bf16 weights and AdamW state, SDPA attention, grouped_mm experts where the version
                has that switch; loss from full logits plus the aux loss.
  moemesh:      bf16 weights and AdamW state, `build(..., dtype=bf16)`, fused linear cross-entropy.
  moemesh fp32-master (--moemesh-fp32-master): fp32 weights and AdamW state under
                torch.autocast(bf16), as `moemesh train` runs today.
  moemesh with activation checkpointing (--recompute full,selective): the bf16 row again, each
                decoder layer recomputed in backward (train.activation_checkpointing).
  moemesh packed (--packed N): the bf16 row on chat rows of ~N tokens packed into each sequence
                as `data/packing.py` packs them (positions restarting, attention within each row,
                the second half of each row trained); --record puts it beside the raw-text row.
Several GPUs (torchrun, moemesh only, --batch sequences per GPU): --layout ep or dp_shard over all
ranks (FSDP2: the shards gathered before each block, gradients reduce-scattered), bf16 weights and
AdamW state as on one GPU (or fp32 weights under autocast, FSDP gathering them in bf16, with
--moemesh-fp32-master), data parallel over all ranks, loss = rank_loss(...), reduce_gradients, AdamW.

Reported: tokens/s (median step time of --steps after --warmup), MFU, peak memory (max allocated
after the first step, so weights, gradients and AdamW state are in it; max over ranks), final loss,
moemesh/transformers ratios; for moemesh the host synchronisations in one step (CUDA sync debug
mode) and a profiler summary of one step (top kernels, GEMM / NCCL / other shares of kernel time).

MFU = tokens/s × flops_per_token / (peak bf16 FLOP/s per GPU × GPUs), with flops_per_token (from
moemesh.train.flops) = 6 × active parameters excluding the embedding table (only top-k of each
expert bank counts; the LM head does) + 12 · layers · heads · head_dim · seq for attention scores
and values (forward + backward, no causal discount), counted on the whole model before EP splits it.

--trainer: training layouts on the same GPUs and model, through the trainer's own step:

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --trainer [--config configs/gpu_small.toml]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --trainer --config configs/qwen3_30b_a3b_6l.toml \\
        --seq 4096 --micro 1 --set train.param_dtype=bfloat16 --variants dualpipev,1f1b   (a GPU-bound model)
    PYTHONPATH=. torchrun --nproc-per-node 4 bench/train/step.py --trainer --config configs/qwen3_30b_a3b.toml \\
        --seq 4096 --micro 4 --micro-batches 4 --variants ep,ep-all_to_all   (issue 48's table: the full model)
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --trainer --config configs/tiny.toml --seq 128 \\
        (CPU smoke)

Variants (`VARIANTS`): DualPipeV and 1F1B over all ranks, expert parallelism over all ranks (the
gathering dispatcher, exact all-to-all splits, and the gathering one with each micro-batch's
forward paired with the previous one's backward, their chunks overlapped), FSDP over all ranks, and
on 4 ranks their products; each with --micro-batches micro-batches of --micro sequences a step. For
each: step time, tokens/s per GPU and MFU (the trainer's FLOP count); on GPUs also each rank's peak
memory against the analytical estimate (`moemesh estimate`: parameter state + the activations of
the micro-batches a stage holds at its peak), and from one profiled step each rank's idle share (no
compute kernel running; NCCL kernels waiting on a peer count as idle), the share where only NCCL
ran, and rank 0's kernels that took the most time; under a pipeline, the schedule's simulated
bubble share with backward = 2 × forward.

`--routing model,spread` runs each variant twice: with the model's router, and with each token's
k experts spread by a fixed pseudo-random pattern of its position (the router's probabilities at
those experts still weight the outputs and train it). A random-init router on byte-level text
sends one rank of ep=4 up to 2.7× the mean load; the spread pattern is balanced within a few
percent, so the two rows part the cost of the layout's own mechanism from that of the router's
imbalance (Megatron-Core's `moe_router_force_load_balancing`, a benchmark-only switch likewise).

--layouts: one run config under several parallel layouts of the same processes, side by side:

    PYTHONPATH=. torchrun --nproc-per-node 4 bench/train/step.py --layouts "pp=2,ep=2;ep=2,tp=2;dp_shard=2,ep=2"
    PYTHONPATH=. torchrun --nproc-per-node 8 bench/train/step.py --layouts "pp=2,ep=2,tp=2;pp=2,dp_shard=2,ep=2"
    PYTHONPATH=. python3 bench/train/step.py --layouts ""     (the one-process reference of the same steps)
    PYTHONPATH=. torchrun --nproc-per-node 4 bench/train/step.py --config configs/tiny.toml --steps 5 \\
        --set train.seq_len=64 --layouts "pp=2,ep=2;ep=2,tp=2;dp_shard=2,ep=2"     (CPU, gloo)

Each layout trains `--steps` steps of the same global batch from the same initial weights (the
trainer's own step); the table gives the loss after the last step, the largest relative difference
of any step's loss from the first layout's, tokens/s, MFU and the peak memory of the busiest GPU.
Layouts are `;`-separated lists of `axis=size` over the `parallel.*` keys; the sizes of each must
multiply to the number of processes. With `--reference FILE` (the `--save` of another run, e.g. one
GPU) the losses are compared to that run's instead.

--fsdp: FSDP (dp_shard) against plain data parallelism on the same GPUs, through the trainer's own
step (forward, backward, gradient reduction, clipping, AdamW):

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --fsdp [--layers 8] [--seq 4096] [--sequences 2]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/train/step.py --fsdp --config configs/tiny.toml --seq 256 \\
        (CPU smoke)

A Qwen3-30B-A3B-shaped model cut to --layers layers, bf16 compute, fp32 weights and AdamW state.
Variants: replicated (dp_replicate: every GPU holds everything, gradients all-reduced), FSDP with
explicit prefetch (the default), FSDP without it (FSDP2's own order: a block's all-gather is issued
when the block starts), FSDP keeping gathered weights from forward to backward. For each: step
time, tokens/s, peak memory per GPU (after setup), and from a profiled step the time in NCCL
kernels and the share of it that ran while a compute kernel was running too.

--record (every mode): tokens/s (per GPU over several), MFU and peak memory to the results file
(bench/harness.py's `record`), against transformers' on one GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from bench.harness import (
    RANK,
    WORLD,
    add_model_arguments,
    add_modes,
    add_record_flag,
    bench_model_config,
    busy_intervals,
    chat_rows,
    chosen_mode,
    describe_device,
    free,
    intersection_length,
    interval_length,
    kernel_intervals,
    kernels_by_name,
    median_ms,
    merged,
    model_at,
    packed_rows,
    print_table,
    profiled_kernels,
    record,
    split_intervals,
    transformers_model,
)
from moemesh.config import DataConfig, ParallelConfig, RunConfig, TrainConfig, load_config
from moemesh.models import ModelConfig, MoECausalLM, build, moe
from moemesh.parallel.data import (
    apply_data_parallel,
    clip_grad_norm_,
    label_tokens,
    rank_loss,
    reduce_gradients,
)
from moemesh.parallel.expert import apply_ep
from moemesh.parallel.fsdp import apply_fsdp
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.pipeline.memory import run_costs, stage_ranges
from moemesh.parallel.pipeline.partition import rank_memory
from moemesh.parallel.pipeline.schedule import build_schedule, peak_in_flight, simulate
from moemesh.train.flops import flops_per_token, peak_flops
from moemesh.train.trainer import Trainer

MODES = {
    "--trainer": "the trainer's own step under named layouts (pipeline schedules, EP, FSDP, their products)",
    "--layouts": "LAYOUTS: one run config under `;`-separated layouts of axis=size, the losses compared",
    "--fsdp": "FSDP (dp_shard) against plain data parallelism, the trainer's step",
}
GEMM_PIECES = ("gemm", "cutlass", "sm90", "nvjet", "matmul", "grouped")


# ---- shared by the modes ---------------------------------------------------------------------------


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's `value` (this one's alone without a process group)."""
    t = torch.tensor(value, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def peak_gib(device: torch.device) -> float:
    """The most memory allocated since the last reset, GiB, max over the ranks."""
    return max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30, device)


def timed_steps(trainer: Trainer, warmup: int, steps: int) -> tuple[float, list[dict]]:
    """The trainer's median step in ms over `steps` after `warmup`, and every step's record. On a
    GPU a step first: it allocates the optimizer state, which belongs in the peak (reset after it);
    the setup before it does not (e.g. the whole model built on each GPU before sharding)."""
    records = []
    if trainer.device.type == "cuda":
        trainer.train_step()
        torch.cuda.reset_peak_memory_stats()
    return median_ms(lambda: records.append(trainer.train_step()), warmup=warmup, repeat=steps), records


def trainer_mfu(trainer: Trainer, tokens_per_s: float) -> float | None:
    """The model FLOPs utilisation of `tokens_per_s` (the trainer's FLOP count), None without a peak."""
    if trainer.peak_flops is None:
        return None
    return tokens_per_s * trainer.flops_per_token / (trainer.peak_flops * WORLD)


def numbers(at: dict | None, tokens_per_s: float, mfu: float | None = None, peak: float | None = None) -> dict:
    """A row's figures for `record_rows`: `at` its variant's keys in the results file (None: not
    recorded), its tokens/s over all ranks, MFU and peak GiB."""
    return {"_at": at, "_tps": tokens_per_s, "_mfu": mfu, "_peak": peak}


def record_rows(args, rows: list[dict], peer: dict | None = None, baseline: float | None = None) -> None:
    """--record: each row's tokens/s, MFU and peak memory: on one GPU beside `peer`'s (transformers'),
    else per GPU at gpus=N (one GPU's too, without a peer), beside `baseline` (one GPU's tokens/s)."""
    if not args.record:
        return
    gpus = {} if peer else {"gpus": WORLD}
    memory = "GiB per GPU" if WORLD > 1 else "GiB"
    for row in rows:
        if row is peer or row.get("_at") is None:
            continue
        at = {**model_at(args), **gpus, **row["_at"]}
        if "packed" in at:  # packed chat rows beside raw text of the same tokens, both moemesh's
            raw = next(r for r in rows if r.get("_at") == {})
            record("train tokens/s", at, row["_tps"], "tokens/s", "moemesh raw text", raw["_tps"])
            continue
        if peer:
            record("train tokens/s", at, row["_tps"], "tokens/s", "transformers", peer["_tps"])
        else:
            record(
                "train tokens/s per GPU", at, row["_tps"] / WORLD, "tokens/s", "one GPU" if baseline else "", baseline
            )
        for key, figure, unit, scale in (
            ("_mfu", "train MFU", "%", 100),
            ("_peak", "train peak memory GiB", memory, 1),
        ):
            if row.get(key) is not None:
                theirs = peer[key] * scale if peer and peer.get(key) is not None else None
                record(figure, at, row[key] * scale, unit, "" if theirs is None else "transformers", theirs)


def same_columns(rows: list[dict]) -> list[dict]:
    """Every row with the columns of the longest, in its order (a failed variant's row is short)."""
    return [{key: row.get(key, "") for key in max(rows, key=len)} for row in rows]


# ---- the step assembled here: one GPU against transformers, or --layout over several --------------


def model_config(args) -> ModelConfig:
    config = bench_model_config(args)
    return config.replace(max_position_embeddings=max(config.max_position_embeddings, args.seq))


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    # fused (one kernel for all parameters) on GPU; the foreach path elsewhere
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)


def kernel_summary(step, trace: Path | None = None) -> tuple[list[dict], dict[str, float]]:
    """Profile one step: the top 10 kernels by total time, and the shares of kernel time in GEMMs,
    NCCL and the rest (summed kernel durations, overlaps counted twice), and of the step's span
    in which no kernel ran ("GPU idle"). `trace`: also keep the step's Chrome trace (gzipped)."""
    kernels = profiled_kernels(step, trace)
    by_name = kernels_by_name(kernels, width=None)
    all_us = sum(us for _, us, _ in by_name) or 1.0
    shares = Counter()
    for name, us, _ in by_name:
        low = name.lower()
        kind = "NCCL" if "nccl" in low else "GEMM" if any(p in low for p in GEMM_PIECES) else "other"
        shares[kind] += us / all_us
    top = [
        {
            "kernel": (name[:90] + "…") if len(name) > 90 else name,
            "calls": calls,
            "ms": f"{us / 1e3:.2f}",
            "share": f"{us / all_us:.1%}",
        }
        for name, us, calls in by_name[:10]
    ]
    busy = busy_intervals(kernels)
    shares["GPU idle"] = 1 - interval_length(busy) / (busy[-1][1] - busy[0][0]) if busy else 0.0
    return top, {k: shares[k] for k in ("GEMM", "NCCL", "other", "GPU idle")}


def count_syncs(step) -> int:
    """Host synchronisations in one step, as CUDA's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the mode warns from one place: do not let the filter dedupe it
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def run_variant(
    name: str, model, forward, args, config: ModelConfig, device, flops: float, extra: dict, at: dict | None = None
) -> dict:
    """Time forward + backward + (reduce) + AdamW + zero_grad; `forward(ids) -> loss` gives this
    rank's loss on its local batch."""
    optimizer = adamw(model, device)
    generator = torch.Generator().manual_seed(1234)
    batch = torch.randint(config.vocab_size, (args.batch * WORLD, args.seq), generator=generator)
    local = batch[RANK * args.batch : (RANK + 1) * args.batch]  # each rank its own sequences
    ids = local.to(device)
    losses = []

    def step():
        loss = forward(ids, local, batch)
        loss.backward()
        if extra.get("moemesh"):
            reduce_gradients(model, extra["mesh"])
            clip_grad_norm_(model, 1.0, extra["mesh"])
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no .item() here: that would sync inside the step

    on_gpu = device.type == "cuda"
    step()  # the first step allocates the AdamW state: it belongs in the peak, setup before it does not
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, warmup=max(args.warmup - 1, 0), repeat=args.steps)
    tokens_per_s = args.batch * WORLD * args.seq / ms * 1e3
    peak = peak_flops(device)
    mfu = tokens_per_s * flops / (peak * WORLD) if peak else None
    loss = losses[-1].float()
    if WORLD > 1:  # each rank holds its share of the loss: the sum is the global one
        dist.all_reduce(loss)
    row = {
        "variant": name,
        "step ms": f"{ms:.0f}",
        "tokens/s": f"{tokens_per_s:,.0f}",
        "tokens/s/GPU": f"{tokens_per_s / WORLD:,.0f}",
        "MFU": f"{mfu:.1%}" if mfu is not None else "n/a",
        "peak GiB": "n/a",
        "loss": f"{loss.item():.4f}",
        "syncs/step": "n/a",
        **numbers(at, tokens_per_s, mfu),
    }
    if on_gpu:
        row["_peak"] = peak_gib(device)
        row["peak GiB"] = f"{row['_peak']:.1f}"
        if extra.get("moemesh"):
            row["syncs/step"] = str(count_syncs(step))
            if extra.get("profile"):
                trace = None
                if args.trace_dir:
                    layout = f"{args.layout}{WORLD}" if WORLD > 1 else "1gpu"
                    trace = Path(args.trace_dir) / f"e2e_{layout}_rank{RANK}.json.gz"
                row["_profile"] = kernel_summary(step, trace)
    return row


def moemesh_forward(model, config: ModelConfig, autocast: bool, mesh=None, packed=None):
    """`packed`: (positions, trained mask) of packed chat rows (`chat_rows` in their sequences,
    `packed_rows`), else one document a sequence, every token trained."""
    device_type = next(model.parameters()).device.type
    ranks = mesh.dims.batch_size if mesh is not None else 1
    if packed is not None:
        positions, trained = (t.to(next(model.parameters()).device) for t in packed)

    def forward(ids, local, batch):
        labels = ids if packed is None else torch.where(trained, ids, -100)
        with torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            if packed is None:
                out = model(ids, labels=labels, return_logits=False)
            else:
                out = model(ids, labels=labels, positions=positions, return_logits=False)
        if mesh is None:
            return out.loss  # ce + coef · aux
        # label counts from the host copies: no device sync
        return rank_loss(
            out.ce_loss, out.aux_loss, label_tokens(local), label_tokens(batch), config.router_aux_loss_coef, ranks
        )

    return forward


def timing_arguments(parser: argparse.ArgumentParser, seq: int) -> None:
    """Every mode's but --layouts': the sequences' length, the steps untimed and timed."""
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)


def step_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, layers=6)
    timing_arguments(parser, seq=4096)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moemesh-fp32-master",
        action="store_true",
        help="add a row (one GPU) or use (several) fp32 weights and AdamW state under bf16 autocast",
    )
    parser.add_argument("--layout", choices=["ep", "dp_shard"], default="ep", help="the layout over GPUs (torchrun)")
    parser.add_argument("--trace-dir", help="keep each rank's Chrome trace of the profiled step here (gzipped)")
    parser.add_argument(
        "--no-reshard",
        action="store_true",
        help="dp_shard: keep each block's gathered weights from forward to backward (one all-gather per step)",
    )
    parser.add_argument(
        "--packed",
        type=int,
        metavar="N",
        help="one GPU: also a step on chat rows of ~N tokens packed (positions restart, half trained)",
    )
    parser.add_argument("--single-gpu-baseline", type=float, help="moemesh tokens/s on one GPU: print the scaling")
    parser.add_argument(
        "--recompute", default="", help="one GPU: moemesh rows with these activation checkpointing modes too (full,...)"
    )


def assembled_step(args) -> None:
    """The step assembled here: on one GPU against transformers, under torchrun in --layout."""
    recompute = [mode for mode in args.recompute.split(",") if mode]
    torch.backends.cuda.matmul.allow_tf32 = True  # only the fp32 leftovers; GEMMs run in bf16
    config = model_config(args)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    # The model's arithmetic, the same for both implementations; on a meta-device moemesh model of
    # the whole config (before EP drops experts), which allocates nothing.
    with torch.device("meta"):
        flops = flops_per_token(MoECausalLM(config), args.seq)
    rows = []
    if WORLD == 1:
        model, title = transformers_model(config, device)
        rows.append(
            run_variant(
                title,
                model,
                lambda ids, local, batch: model(input_ids=ids, labels=ids).loss,
                args,
                config,
                device,
                flops,
                {},
            )
        )
        del model
        free()
        variants = [("moemesh (bf16)", torch.bfloat16, False, "none", {})]  # the last: the keys of --record's rows
        if args.packed:  # the rows' positions and trained mask; the tokens stay the raw step's
            chat = chat_rows(args.batch, args.seq, args.packed, config.vocab_size, args.seed)
            packed = packed_rows(chat, args.seq)[1:]
            variants.append(
                (
                    f"moemesh (bf16, chat rows of ~{args.packed} tokens packed)",
                    torch.bfloat16,
                    False,
                    "none",
                    {"packed": args.packed},
                )
            )
        for mode in recompute:
            variants.append((f"moemesh (bf16, {mode} recompute)", torch.bfloat16, False, mode, {"recompute": mode}))
        if args.moemesh_fp32_master:
            variants.append(("moemesh (fp32 master, bf16 autocast)", None, True, "none", {"weights": "fp32"}))
        for name, dtype, autocast, mode, at in variants:
            model = build(config, seed=args.seed, device=device, dtype=dtype)
            model.activation_checkpointing = mode
            rows.append(
                run_variant(
                    name,
                    model,
                    moemesh_forward(
                        model,
                        config,
                        autocast,
                        packed=packed if "packed" in at else None,
                    ),
                    args,
                    config,
                    device,
                    flops,
                    {"moemesh": True, "profile": len(rows) == 1, "mesh": init_mesh(ParallelDims())},
                    at,
                )
            )
            del model
            free()
    else:
        mesh = init_mesh(ParallelDims(**{args.layout: WORLD}))
        fp32 = args.moemesh_fp32_master  # fp32 weights (FSDP: fp32 shards gathered in bf16) under autocast
        model = build(config, seed=args.seed, device=device, dtype=None if fp32 else torch.bfloat16)
        apply_data_parallel(apply_ep(model, mesh), mesh)
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reshard_after_forward=not args.no_reshard)  # dp_shard only
        keep = ", gathered weights kept for backward" if args.no_reshard and args.layout == "dp_shard" else ""
        name = f"moemesh {args.layout}={WORLD} ({'fp32 master, bf16 autocast' if fp32 else 'bf16'}{keep})"
        at = {"layout": args.layout, "weights": "fp32" if fp32 else None, "reshard": "no" if keep else None}
        rows.append(
            run_variant(
                name,
                model,
                moemesh_forward(model, config, fp32, mesh),
                args,
                config,
                device,
                flops,
                {"moemesh": True, "profile": True, "mesh": mesh},
                at,
            )
        )
        if args.single_gpu_baseline:
            rows[0]["scaling"] = f"{rows[0]['_tps'] / (args.single_gpu_baseline * WORLD):.0%} of {WORLD}× 1 GPU"

    if RANK == 0:
        base = rows[0]
        for row in rows:
            if WORLD == 1:
                row["tokens/s vs transformers"] = f"{row['_tps'] / base['_tps']:.2f}x"
                row["memory vs transformers"] = f"{row['_peak'] / base['_peak']:.2f}x" if base["_peak"] else "n/a"
        model = args.config or f"{args.layers}-layer Qwen3-30B-A3B shape"
        print(
            f"device: {WORLD}× {describe_device(device)}; model: {model}, "
            f"{args.batch}×{args.seq} tokens per GPU, {flops / 1e9:.3g} GFLOP per token"
        )
        profiles = [(row["variant"], row.pop("_profile")) for row in rows if "_profile" in row]
        gpus = f"{WORLD} {'GPU' if WORLD == 1 else 'GPUs'}"
        print_table(rows, f"Training step (forward, backward, clipping, AdamW), {gpus}")
        for variant, (top, shares) in profiles:
            print_table(
                top,
                f"Top kernels of one step, {variant} (rank 0): GEMM {shares['GEMM']:.0%}, "
                f"NCCL {shares['NCCL']:.0%}, other {shares['other']:.0%} of kernel time; "
                f"GPU idle {shares['GPU idle']:.0%} of the step",
            )
        if not profiles:
            print("\nprofiler summary: n/a (no GPU)")
    record_rows(args, rows, peer=rows[0] if WORLD == 1 else None, baseline=args.single_gpu_baseline)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- --trainer: the trainer's step under named layouts ---------------------------------------------

# Every variant sets every axis, whatever the config's [parallel] section says.
ONE = ["parallel.pp=1", "parallel.dp_shard=1", "parallel.ep=1"]
VARIANTS = {
    "dualpipev": [*ONE, "parallel.pp_schedule=dualpipev", f"parallel.pp={WORLD}"],
    "1f1b": [*ONE, "parallel.pp_schedule=1f1b", f"parallel.pp={WORLD}"],
    "ep": [*ONE, f"parallel.ep={WORLD}"],
    "ep-all_to_all": [*ONE, f"parallel.ep={WORLD}", "parallel.ep_dispatch=all_to_all"],
    # the next micro-batch's forward overlapping this one's backward (`schedule.paired`)
    "ep-paired": [*ONE, f"parallel.ep={WORLD}", "parallel.pp_overlap=true"],
    # ... the step as one CUDA graph (train.cuda_graphs), without and with the pairs
    "ep-graphs": [*ONE, f"parallel.ep={WORLD}", "train.cuda_graphs=true"],
    "ep-paired-graphs": [*ONE, f"parallel.ep={WORLD}", "parallel.pp_overlap=true", "train.cuda_graphs=true"],
    "dp_shard": [*ONE, f"parallel.dp_shard={WORLD}"],
}
if WORLD >= 4 and WORLD % 2 == 0:  # pp × ep=2: DualPipeV's paired chunks overlapped (EP collectives hidden) or not
    VARIANTS.update(
        {
            f"dualpipev-ep2-{mode}": [
                *ONE,
                "parallel.pp_schedule=dualpipev",
                f"parallel.pp={WORLD // 2}",
                "parallel.ep=2",
                f"parallel.pp_overlap={str(on).lower()}",
            ]
            for mode, on in (("overlap", True), ("sequential", False))
        }
    )
    VARIANTS[f"dp_shard{WORLD // 2}-ep2"] = [*ONE, f"parallel.dp_shard={WORLD // 2}", "parallel.ep=2"]


def spread_routed(logits: torch.Tensor, k: int, renormalize: bool):
    """`moe.routed` with each token's k experts fixed by its position t: the k largest of
    frac(43758.5453 · sin(12.9898 t + 78.233 e)) over the experts e — the same in a recomputed
    forward (no random state), spread over every expert-parallel rank, close to balanced."""
    tokens, experts = logits.shape
    t = torch.arange(tokens, device=logits.device, dtype=torch.float32)[:, None]
    e = torch.arange(experts, device=logits.device, dtype=torch.float32)[None, :]
    ids = torch.frac(torch.sin(12.9898 * t + 78.233 * e) * 43758.5453).abs().topk(k, dim=-1).indices
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights = probs.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, ids, moe.choice_counts(ids, experts)


ROUTINGS = {"model": moe.routed, "spread": spread_routed}


def step_profile(trainer: Trainer, trace: Path | None = None) -> tuple[float, float, list[tuple[str, float]]]:
    """One profiled step: the share of its GPU time during which no compute kernel ran, the share
    during which only NCCL ran, and the kernels that took the most time (name, ms in the step).
    `trace`: keep the step's Chrome trace, host side included."""
    torch.cuda.synchronize()
    kernels = profiled_kernels(trainer.train_step, trace, host=trace is not None)
    nccl, compute = split_intervals(kernels)
    everything = merged(nccl + compute)
    span = everything[-1][1] - everything[0][0]
    busy = interval_length(compute)
    top = [(name, us / 1e3) for name, us, _ in kernels_by_name(kernels, width=60)[:8]]
    return 1 - busy / span, (interval_length(everything) - busy) / span, top


def bubble_share(trainer: Trainer) -> float:
    """The share of one step this rank spent outside its operations' compute: waiting for a peer's
    activation or gradient (the pipeline bubble), plus the gradient reduction and optimizer step."""
    runner = trainer.pipeline
    runner.op_times = []
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    trainer.train_step()
    end.record()
    end.synchronize()
    busy = sum(a.elapsed_time(b) for a, b in runner.op_times)
    runner.op_times = None
    return 1 - busy / start.elapsed_time(end)


def state_bytes(trainer: Trainer) -> int:
    """Bytes of this rank's parameter state during a step: parameters, their gradients (as large
    as the parameters) and the optimizer state."""
    params = sum(2 * p.numel() * p.element_size() for p in trainer.model.parameters())
    return params + sum(
        v.numel() * v.element_size()
        for state in trainer.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def op_trace(trainer: Trainer) -> list[dict]:
    """One step with every pipeline operation's memory recorded: allocated before it, the peak
    while it ran and allocated after it (host-side allocator counters, exact without a sync), and
    CUDA events at its start (before its receive) and end. The step's peak is the largest 'peak'."""
    runner, records = trainer.pipeline, []

    def wrap(name, method):
        def traced(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            start.record()
            method(*args, **kwargs)
            end.record()
            ids = list(args[:2])
            if name == "FB":  # an FB operation passes its Op: name both of its chunks
                ids = [args[0].stage, args[0].micro, args[0].b_stage, args[0].b_micro]
            records.append(
                {
                    "op": name,
                    "args": ids,
                    "before": before,
                    "peak": torch.cuda.max_memory_allocated(),
                    "after": torch.cuda.memory_allocated(),
                    "_events": (start, end),
                }
            )

        return traced

    runner._forward, runner._backward = wrap("F", runner._forward), wrap("B", runner._backward)
    runner._forward_backward = wrap("FB", runner._forward_backward)
    runner.weight_grads.pop = wrap("W", runner.weight_grads.pop)
    step_start = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    step_start.record()
    trainer.train_step()
    torch.cuda.synchronize()
    for name in ("_forward", "_backward", "_forward_backward"):
        delattr(runner, name)
    del runner.weight_grads.pop
    for r in records:
        start, end = r.pop("_events")
        r["start ms"], r["end ms"] = step_start.elapsed_time(start), step_start.elapsed_time(end)
    return records


def trainer_variant(name: str, overrides: list[str], args) -> tuple[dict, list[tuple[str, float]]]:
    """The variant's row, and rank 0's kernels that took the most time in a profiled step."""
    config = load_config(
        args.config,
        [
            *overrides,
            f"train.seq_len={args.seq}",
            f"train.global_batch={args.micro * args.micro_batches}",
            f"train.micro_batch={args.micro}",
            "train.eval_sequences=8",
            *args.set,
        ],
    )
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    on_gpu = trainer.device.type == "cuda"
    step_ms, records = timed_steps(trainer, args.warmup, args.steps)
    tokens_per_s = config.train.global_batch * config.train.seq_len / step_ms * 1e3
    mfu = trainer_mfu(trainer, tokens_per_s)
    row = {
        "variant": name,
        "step ms": f"{step_ms:.0f}",
        "tokens/s per GPU": f"{tokens_per_s / WORLD:,.0f}",
        "loss": f"{records[-1]['loss']:.4f}",
        **numbers({"layout": name}, tokens_per_s, mfu),
    }
    if mfu is not None:
        row["MFU"] = f"{mfu:.1%}"
    if trainer.notes:  # a full expert buffer: a forward (or a pipeline's step) ran again
        row["computed again"] = len(trainer.notes)
    # Without a pipeline the whole model is one stage (as `moemesh estimate` counts it).
    schedule = (
        trainer.pipeline.schedule if trainer.pipeline is not None else build_schedule("1f1b", 1, args.micro_batches)
    )
    costs = run_costs(config.model, config.parallel, config.step_shape)
    ranges = stage_ranges(schedule, costs)
    estimate = rank_memory(costs, ranges, peak_in_flight(schedule), list(schedule.stage_rank))
    row["estimate GiB"] = " / ".join(f"{e / 2**30:.1f}" for e in estimate)
    top = []
    if on_gpu:
        peaks = [torch.zeros(WORLD, device=trainer.device) for _ in range(4)]
        peaks[0][RANK] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        trace = Path(args.trace_dir) / f"profile_{name.split()[0]}_rank{RANK}.json.gz" if args.trace_dir else None
        peaks[1][RANK], peaks[2][RANK], top = step_profile(trainer, trace)
        timed_ops = trainer.pipeline is not None and trainer.captured is None  # a replay runs no Python op
        if timed_ops:
            peaks[3][RANK] = bubble_share(trainer)
        for t in peaks:
            if dist.is_initialized():
                dist.all_reduce(t)
        row["_peak"] = max(peaks[0].tolist())
        row["peak GiB per rank"] = " / ".join(f"{p:.1f}" for p in peaks[0].tolist())
        row["GPU idle per rank"] = " / ".join(f"{p:.0%}" for p in peaks[1].tolist())
        row["only NCCL per rank"] = " / ".join(f"{p:.0%}" for p in peaks[2].tolist())
        if timed_ops:
            row["measured bubble per rank"] = " / ".join(f"{p:.0%}" for p in peaks[3].tolist())
            timeline = simulate(schedule, f=1.0, b=1.0, w=1.0)  # backward = input + weight gradient = 2F
            row["simulated bubble per rank"] = " / ".join(f"{b / timeline.makespan:.0%}" for b in timeline.bubble)
            # ... and with each stage's time as the partition estimated it (FLOPs)
            times = [sum(costs[i].time for i in items) for items in ranges]
            timeline = simulate(schedule, 1.0, 1.0, 1.0, stage_time=[t * len(times) / sum(times) for t in times])
            row["simulated with stage FLOPs"] = " / ".join(f"{b / timeline.makespan:.0%}" for b in timeline.bubble)
            if args.trace_dir:
                save_trace(trainer, name, args.trace_dir)
    trainer.close()
    return row, top


def save_trace(trainer: Trainer, name: str, trace_dir: str) -> None:
    """Write this rank's operation trace (`op_trace`) and parameter-state bytes as JSON, and print
    each rank's peak operation."""
    records = op_trace(trainer)
    state = state_bytes(trainer)
    path = Path(trace_dir) / f"pipeline_{name.split()[0]}_rank{RANK}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"state_bytes": state, "ops": records}))
    top = max(records, key=lambda r: r["peak"])
    print(
        f"[{name} rank {RANK}] parameter state {state / 2**30:.2f} GiB; peak {top['peak'] / 2**30:.2f} GiB "
        f"in {top['op']}{top['args']} (allocated before it {top['before'] / 2**30:.2f} GiB, after "
        f"{top['after'] / 2**30:.2f}); {len(records)} operations; step {records[-1]['end ms']:.0f} ms",
        flush=True,
    )


def trainer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default="configs/gpu_small.toml")
    timing_arguments(parser, seq=2048)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch (summed over the ranks)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every variant")
    parser.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--routing", default="model", help="comma-separated: model (the router's choice), spread (balanced; see above)"
    )
    parser.add_argument("--trace-dir", help="write each rank's per-operation memory and time trace here (GPU)")


def trainer_layouts(args, parser: argparse.ArgumentParser) -> None:
    rows = []
    chosen = args.variants.split(",") if args.variants else list(VARIANTS)
    for name in chosen:
        if name not in VARIANTS:
            parser.error(f"unknown variant {name!r} on {WORLD} ranks; choose from {', '.join(VARIANTS)}")
    routings = args.routing.split(",")
    if not set(routings) <= set(ROUTINGS):
        parser.error(f"--routing: choose from {', '.join(ROUTINGS)}")
    runs = [(name, routing) for name in chosen for routing in routings]
    for name, routing in runs:
        moe.routed = ROUTINGS[routing]
        row, top = trainer_variant(name, VARIANTS[name], args)
        if len(routings) > 1:
            row["variant"] = f"{name} ({routing} routing)"
            row["_at"]["routing"] = None if routing == "model" else routing
        rows.append(row)
        free()
        if RANK == 0:
            print({k: v for k, v in row.items() if not k.startswith("_")}, flush=True)
            print(
                f"  [{row['variant']}] rank 0's kernels, ms in a step: " + "; ".join(f"{k} {ms:.1f}" for k, ms in top),
                flush=True,
            )
    if RANK == 0:
        print_table(
            same_columns(rows),
            f"training layouts, {args.config}, {args.micro_batches} micro-batches of {args.micro}×{args.seq} "
            f"tokens, {WORLD} GPUs{' (' + ' '.join(args.set) + ')' if args.set else ''}",
        )
    record_rows(args, rows)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- --layouts: one run config under lists of axis sizes, the losses compared ------------------------


def run_layout(layout: str, args) -> tuple[dict, list[float]]:
    sizes = [f"parallel.{item}" for item in layout.split(",") if item]
    config = load_config(args.config, [*args.set, f"train.steps={args.steps}", *sizes])
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        step = trainer.train_step()  # returns plain numbers: the step has finished on the device
        times.append(time.perf_counter() - start)
        losses.append(step["loss"])
    tokens = config.train.global_batch * config.train.seq_len
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median, the first step aside
    mfu = trainer_mfu(trainer, tokens / step_s)
    row = {
        "layout": layout or "one process",
        "loss": f"{losses[-1]:.4f}",
        "tokens/s": f"{tokens / step_s:,.0f}",
        **numbers({"layout": layout or "one process"}, tokens / step_s, mfu),
    }
    if mfu is not None:
        row["MFU"] = f"{mfu:.1%}"
        row["_peak"] = peak_gib(trainer.device)
        row["peak GiB/GPU"] = f"{row['_peak']:.1f}"
    return row, losses


def layouts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", required=True, help="this mode: " + MODES["--layouts"])
    parser.add_argument("--config", default="configs/gpu_small.toml")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every layout")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save", help="write the first layout's per-step losses to this JSON file")
    parser.add_argument("--reference", help="compare losses with a --save file instead of the first layout")


def layouts(args, parser: argparse.ArgumentParser) -> None:
    rows, curves = [], []
    for layout in args.layouts.split(";"):
        row, losses = run_layout(layout, args)
        rows.append(row)
        curves.append(losses)
        free()
    reference = json.load(open(args.reference)) if args.reference else curves[0]
    for row, losses in zip(rows, curves):
        row["max rel. loss diff"] = f"{max(abs(a - b) / abs(b) for a, b in zip(losses, reference)):.1e}"
    if RANK == 0:
        if args.save:
            json.dump(curves[0], open(args.save, "w"))
        print_table(rows, f"{args.config}, {args.steps} steps, {WORLD} processes")
    record_rows(args, rows)
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- --fsdp: FSDP against replicated data parallelism --------------------------------------------------

FSDP_VARIANTS = {  # the replicated one last: it is the one that may run out of memory
    "fsdp": dict(dp_shard=WORLD),
    "fsdp-no-prefetch": dict(dp_shard=WORLD, fsdp_prefetch=False),
    "fsdp-keep-after-forward": dict(dp_shard=WORLD, fsdp_reshard_after_forward=False),
    "replicated": dict(dp_replicate=WORLD),
}


def comm_overlap(trainer: Trainer) -> tuple[float, float]:
    """Profile one step: (ms in NCCL kernels, fraction of it overlapped by compute kernels)."""
    nccl, compute = kernel_intervals(trainer.train_step)
    comm_us = interval_length(nccl)
    return comm_us / 1e3, (intersection_length(nccl, compute) / comm_us if comm_us else 0.0)


def fsdp_variant(name: str, parallel: dict, args) -> dict:
    config = RunConfig(
        model=bench_model_config(args),
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            global_batch=args.sequences * WORLD,
            micro_batch=args.sequences * WORLD,
            seq_len=args.seq,
            eval_sequences=WORLD,
            run_dir="/tmp/bench_fsdp",
            warmup_steps=1,
            steps=100,
        ),
        data=DataConfig(),
    )
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    step_ms, records = timed_steps(trainer, args.warmup, args.steps)
    tokens = args.sequences * WORLD * args.seq
    row = {
        "variant": name,
        "layout": " ".join(f"{k}={v}" for k, v in parallel.items()),
        "step ms": f"{step_ms:.0f}",
        "tokens/s": f"{tokens / step_ms * 1e3:,.0f}",
        "loss": f"{records[-1]['loss']:.4f}",
        **numbers({"layout": name}, tokens / step_ms * 1e3, trainer_mfu(trainer, tokens / step_ms * 1e3)),
    }
    if trainer.device.type == "cuda":
        row["_peak"] = peak_gib(trainer.device)
        comm_ms, overlapped = comm_overlap(trainer)
        row.update(
            {
                "peak GiB/GPU": f"{row['_peak']:.1f}",
                "NCCL ms/step": f"{comm_ms:.0f}",
                "NCCL overlapped": f"{overlapped:.0%}",
            }
        )
    return row


def fsdp_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, layers=8)
    timing_arguments(parser, seq=4096)
    parser.add_argument("--sequences", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--variants", default=",".join(FSDP_VARIANTS), help="comma-separated names to run")


def fsdp(args, parser: argparse.ArgumentParser) -> None:
    rows = []
    for name in args.variants.split(","):
        try:
            rows.append(fsdp_variant(name, FSDP_VARIANTS[name], args))
        except torch.OutOfMemoryError:
            rows.append({"variant": name, "step ms": "out of memory"})
        free()  # the variant's model and optimizer state, before the next one
        if RANK == 0:
            print({k: v for k, v in rows[-1].items() if not k.startswith("_")}, flush=True)
    if RANK == 0:
        model = args.config or f"{args.layers}-layer Qwen3-30B-A3B shape"
        print_table(
            same_columns(rows), f"FSDP vs replicated, {model}, {args.sequences}×{args.seq} tokens per GPU, {WORLD} GPUs"
        )
    record_rows(args, rows)
    if dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    mode = chosen_mode(argv, MODES)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    arguments, run = {
        None: (step_arguments, lambda args, parser: assembled_step(args)),
        "--trainer": (trainer_arguments, trainer_layouts),
        "--layouts": (layouts_arguments, layouts),
        "--fsdp": (fsdp_arguments, fsdp),
    }[mode]
    arguments(parser)
    add_record_flag(parser)
    add_modes(parser, MODES)
    run(parser.parse_args(argv), parser)


if __name__ == "__main__":
    main()
