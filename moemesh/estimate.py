"""The `moemesh estimate` report: per-layer parameter state, activations and time (analytical, or
measured with --profile), their split into the pipeline stages of a schedule, and each rank's
memory at its peak. The cost model and the profiler live in `parallel/pipeline/memory.py`."""

from __future__ import annotations

import dataclasses

import torch

from moemesh.config import RunConfig, resolve_device
from moemesh.models import build
from moemesh.parallel.parallelize import step_schedule
from moemesh.parallel.pipeline.memory import (
    profile_costs,
    profile_layers,
    rank_param_counts,
    rank_tokens,
    run_costs,
    stage_ranges,
    state_bytes_per_param,
)
from moemesh.parallel.pipeline.partition import describe, rank_memory
from moemesh.parallel.pipeline.schedule import build_schedule, peak_in_flight


def estimate_run(
    config: RunConfig, pp: int | None = None, schedule_name: str | None = None, profile: bool = False
) -> str:
    """The `moemesh estimate` report: per-item costs (analytical, or measured with `profile`), their
    partition into the stages of the pipeline schedule, and each rank's memory at its peak."""
    config = resolve_device(config)
    train, parallel = config.train, config.parallel
    pp = parallel.pp if pp is None else pp
    step = config.step_shape
    if schedule_name:
        schedule = build_schedule(schedule_name, pp, step.micro_batches)
    else:  # the run's own; without a pipeline, one stage
        schedule = step_schedule(dataclasses.replace(parallel, pp=pp), step) or build_schedule(
            "1f1b", 1, step.micro_batches
        )
    schedule_name = schedule.name
    in_flight = peak_in_flight(schedule)
    tokens = rank_tokens(parallel, step)
    if profile:
        device = torch.device(train.device)
        model = build(config.model, train.seed, device)
        ids = torch.randint(
            config.model.vocab_size, (train.micro_batch // parallel.batch_ranks, train.seq_len), device=device
        )
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=train.dtype == "bfloat16"):
            costs = profile_costs(
                profile_layers(model, ids, ids),
                state_bytes_per_param(step),
                rank_params=rank_param_counts(config.model, parallel),
            )  # what one GPU keeps under the layout
        time_unit, time_scale = "ms", 1e3
    else:
        costs = run_costs(config.model, parallel, step)
        time_unit, time_scale = "GFLOP", 1e-9
    ranges = stage_ranges(schedule, costs)

    how = f"measured on {train.device}" if profile else "analytical"
    layout = (
        f"dp_replicate={parallel.dp_replicate} × dp_shard={parallel.dp_shard} × ep={parallel.ep} × tp={parallel.tp}"
    )
    lines = [
        (
            f"per layer ({how}; {tokens} tokens per micro-batch, {train.dtype}; parameter state "
            f"{state_bytes_per_param(step)} B/parameter of what one GPU keeps under {layout}):"
        ),
        f"  {'layer':<10} {'param state':>12} {'activations':>12} {'time ' + time_unit:>12}",
    ]
    lines += [
        f"  {c.name:<10} {_bytes(c.param_bytes):>12} {_bytes(c.activation_bytes):>12} {c.time * time_scale:>12.3f}"
        for c in costs
    ]
    lines += [
        "",
        (f"stages ({schedule_name}, pp={pp}, {step.micro_batches} micro-batches):"),
        f"  {'stage':>5} {'rank':>4}  {'layers':<22} {'in flight':>9} {'memory':>12} {'time ' + time_unit:>12}",
    ]
    lines += [
        f"  {row['stage']:>5} {row['rank']:>4}  {row['layers']:<22} {row['in_flight']:>9} "
        f"{_bytes(row['memory']):>12} {row['time'] * time_scale:>12.3f}"
        for row in describe(costs, ranges, in_flight, list(schedule.stage_rank))
    ]
    gpus = pp * parallel.dp_replicate * parallel.dp_shard * parallel.ep * parallel.tp
    lines += ["", f"memory per GPU (parameter state + in-flight activations) on {gpus} GPUs, pp={pp} × {layout}:"]
    lines += [
        f"  pipeline rank {rank}: {_bytes(memory)}"
        for rank, memory in enumerate(rank_memory(costs, ranges, in_flight, list(schedule.stage_rank)))
    ]
    return "\n".join(lines)


def _bytes(count: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"
