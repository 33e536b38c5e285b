"""Training layouts on the same GPUs and model, through the trainer's own step (`Trainer.train_step`):
pipeline schedules, expert parallelism with either dispatcher, fully sharded data parallelism and
their products:

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/pipeline.py [--config configs/gpu_small.toml]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/pipeline.py --config configs/qwen3_30b_a3b_6l.toml --seq 4096 \
        --micro 1 --set train.param_dtype=bfloat16 --variants dualpipev,1f1b   (a GPU-bound model)
    PYTHONPATH=. torchrun --nproc-per-node 4 bench/pipeline.py --config configs/qwen3_30b_a3b.toml --seq 4096 \
        --micro 4 --micro-batches 4 --variants ep,ep-all_to_all   (issue 48's table: the full model)
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/pipeline.py --config configs/tiny.toml --seq 128  (CPU smoke)

Variants (`VARIANTS`): DualPipeV and 1F1B over all ranks, expert parallelism over all ranks (the
gathering dispatcher, exact all-to-all splits, and the gathering one with each micro-batch's
forward paired with the previous one's backward, their chunks overlapped), FSDP over all ranks, and on 4 ranks their
products; each with --micro-batches micro-batches of --micro sequences a step. For each: step time,
tokens/s per GPU and MFU (the trainer's FLOP count); on GPUs also each rank's peak memory against
the analytical estimate (`moemesh estimate`: parameter state + the activations of the micro-batches
a stage holds at its peak), and from one profiled step each rank's idle share (no compute kernel
running; NCCL kernels waiting on a peer count as idle), the share where only NCCL ran, and rank 0's
kernels that took the most time; under a pipeline, the schedule's simulated bubble share with
backward = 2 × forward.

`--routing model,spread` runs each variant twice: with the model's router, and with each token's
k experts spread by a fixed pseudo-random pattern of its position (the router's probabilities at
those experts still weight the outputs and train it). A random-init router on byte-level text
sends one rank of ep=4 up to 2.7× the mean load; the spread pattern is balanced within a few
percent, so the two rows part the cost of the layout's own mechanism from that of the router's
imbalance (Megatron-Core's `moe_router_force_load_balancing`, a benchmark-only switch likewise).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import interval_length, median_ms, merged, print_table, profiled_kernels, split_intervals
from moemesh.config import load_config
from moemesh.models import moe
from moemesh.parallel.pipeline.memory import run_costs, stage_ranges
from moemesh.parallel.pipeline.partition import rank_memory
from moemesh.parallel.pipeline.schedule import build_schedule, peak_in_flight, simulate
from moemesh.train.trainer import Trainer

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
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
    top = Counter()
    for e in kernels:
        top[e["name"][:60]] += e["dur"] / 1e3
    return 1 - busy / span, (interval_length(everything) - busy) / span, top.most_common(8)


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


def run_variant(name: str, overrides: list[str], args) -> tuple[dict, list[tuple[str, float]]]:
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
    records = []
    on_gpu = trainer.device.type == "cuda"
    if on_gpu:
        trainer.train_step()
        torch.cuda.reset_peak_memory_stats()
    step_ms = median_ms(lambda: records.append(trainer.train_step()), warmup=args.warmup, repeat=args.steps)
    tokens_per_s = config.train.global_batch * config.train.seq_len / step_ms * 1e3
    row = {
        "variant": name,
        "step ms": f"{step_ms:.0f}",
        "tokens/s per GPU": f"{tokens_per_s / WORLD:,.0f}",
        "loss": f"{records[-1]['loss']:.4f}",
    }
    if trainer.peak_flops is not None:
        row["MFU"] = f"{tokens_per_s * trainer.flops_per_token / (trainer.peak_flops * WORLD):.1%}"
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
        peaks[0][dist.get_rank()] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
        trace = (
            Path(args.trace_dir) / f"profile_{name.split()[0]}_rank{dist.get_rank()}.json.gz"
            if args.trace_dir
            else None
        )
        peaks[1][dist.get_rank()], peaks[2][dist.get_rank()], top = step_profile(trainer, trace)
        timed_ops = trainer.pipeline is not None and trainer.captured is None  # a replay runs no Python op
        if timed_ops:
            peaks[3][dist.get_rank()] = bubble_share(trainer)
        for t in peaks:
            dist.all_reduce(t)
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
    path = Path(trace_dir) / f"pipeline_{name.split()[0]}_rank{dist.get_rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"state_bytes": state, "ops": records}))
    top = max(records, key=lambda r: r["peak"])
    print(
        f"[{name} rank {dist.get_rank()}] parameter state {state / 2**30:.2f} GiB; peak {top['peak'] / 2**30:.2f} GiB "
        f"in {top['op']}{top['args']} (allocated before it {top['before'] / 2**30:.2f} GiB, after "
        f"{top['after'] / 2**30:.2f}); {len(records)} operations; step {records[-1]['end ms']:.0f} ms",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_small.toml")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=4, help="sequences per micro-batch (summed over the ranks)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every variant")
    parser.add_argument("--variants", help=f"comma-separated subset of: {', '.join(VARIANTS)}")
    parser.add_argument(
        "--routing", default="model", help="comma-separated: model (the router's choice), spread (balanced; see above)"
    )
    parser.add_argument("--trace-dir", help="write each rank's per-operation memory and time trace here (GPU)")
    args = parser.parse_args()
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
        row, top = run_variant(name, VARIANTS[name], args)
        if len(routings) > 1:
            row["variant"] = f"{name} ({routing} routing)"
        rows.append(row)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print(rows[-1], flush=True)
            print(
                f"  [{row['variant']}] rank 0's kernels, ms in a step: " + "; ".join(f"{k} {ms:.1f}" for k, ms in top),
                flush=True,
            )
    if dist.get_rank() == 0:
        rows = [{key: row.get(key, "") for key in max(rows, key=len)} for row in rows]
        print_table(
            rows,
            f"training layouts, {args.config}, {args.micro_batches} micro-batches of {args.micro}×{args.seq} "
            f"tokens, {WORLD} GPUs{' (' + ' '.join(args.set) + ')' if args.set else ''}",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
