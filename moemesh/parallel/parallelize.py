"""The one composition step: a model — made on the meta device — laid out for a run's parallel
layout, in torchtitan's order: expert parallelism (keep this rank's experts), tensor parallelism
(keep this rank's slices), data parallelism (reduce the router statistics over the batch group),
the pipeline cut (keep this rank's stages), FSDP (keep this rank's shards). Then `materialize`
allocates what is left on the device and initialises it from the seed; or a checkpoint is read
into it (`moemesh/checkpoint/load.py`). So no rank ever holds the whole model, and each holds the
values one process would have there (`pieces.py`, `models/build.py`). `train`, `generate` and
`serve` all lay out their model here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moemesh.models.build import init_weights
from moemesh.models.transformer import MoECausalLM
from moemesh.parallel.config import ParallelConfig, StepShape
from moemesh.parallel.data import apply_data_parallel
from moemesh.parallel.expert import apply_ep
from moemesh.parallel.fsdp import apply_fsdp
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pieces import local_view, records_kept
from moemesh.parallel.pipeline.memory import run_costs, stage_ranges
from moemesh.parallel.pipeline.schedule import Schedule, run_schedule
from moemesh.parallel.pipeline.stage import RankStages, cut_model
from moemesh.parallel.tensor import apply_tp

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # train.dtype and param_dtype names


@dataclass
class Layout:
    schedule: Schedule | None  # the pipeline schedule, or None without a pipeline
    stages: RankStages | None  # this pipeline rank's stages (FSDP's root when it shards), or None
    kept_whole: list[str]  # parameters FSDP could not shard evenly


def step_schedule(parallel: ParallelConfig, step: StepShape) -> Schedule | None:
    """The schedule a training step of this layout follows (`schedule.run_schedule`), or None."""
    return run_schedule(
        parallel.pp,
        parallel.pp_schedule,
        parallel.pp_overlap,
        parallel.ep,
        parallel.dp_shard,
        step.micro_batches,
        step.whole_step,
    )


def parallelize(model: MoECausalLM, mesh: Mesh, parallel: ParallelConfig, step: StepShape) -> Layout:
    """Lay `model` out in place for `mesh` and `parallel`; `step` says how many micro-batches the
    pipeline schedules and what they cost (with parallel.pp > 1), and the dtype FSDP gathers in."""
    apply_data_parallel(apply_tp(apply_ep(model, mesh, parallel.ep_dispatch), mesh), mesh)  # TP ranks share their data
    stages = None
    schedule = step_schedule(parallel, step)
    if schedule is not None:  # this rank keeps its stages only, partitioned by estimated memory and time
        ranges = stage_ranges(schedule, run_costs(model.config, parallel, step))
        stages = RankStages(model, cut_model(model, ranges, list(schedule.stage_rank), mesh.rank("pp")))
    kept_whole = apply_fsdp(
        model,
        mesh,
        param_dtype=DTYPES[step.dtype],
        reshard_after_forward=parallel.fsdp_reshard_after_forward,
        prefetch=parallel.fsdp_prefetch,
        root=stages,
    )
    return Layout(schedule, stages, kept_whole)


@torch.no_grad()
def materialize(model: MoECausalLM, device: torch.device | str, seed: int | None = None) -> MoECausalLM:
    """Allocate the parameters and buffers this rank keeps on `device` and, with a `seed`,
    initialise them (without one they hold garbage until a checkpoint is read into them)."""
    with records_kept(model):  # moving FSDP's sharded parameters swaps them for new objects
        model.to_empty(device=device)
        model.tie_weights()
    if seed is not None:
        init_weights(model, seed, local_view)
    return model
