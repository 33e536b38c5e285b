"""`torchrun ... moemesh train --set parallel.ep=N parallel.tp=M` (or parallel.dp_shard=N) on CPU (gloo) against the
same run in one process: the same per-step losses and gradient norms (1e-5 relative: the sharded run sums the same
fp32 terms in another order), and a checkpoint that loads back into one process."""

import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

from moemesh.checkpoint.load import load_model
from moemesh.config import load_config
from moemesh.models import build
from moemesh.train.progress import format_count
from moemesh.train.trainer import train
from tiny_run import write_tiny_toml

STEPS = 5
OVERRIDES = [
    f"train.steps={STEPS}",
    "train.global_batch=8",
    "train.micro_batch=4",
    "train.eval_every=0",
    "train.save_every=0",
    "model.num_experts=8",
    "model.num_experts_per_tok=3",
]


def torchrun(nproc: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ep")
    config_file = write_tiny_toml(directory)
    run_dir = directory / "single"
    train(load_config(config_file, [*OVERRIDES, f"train.run_dir={run_dir}"]))
    return config_file, run_dir


AXES = ("dp_replicate", "dp_shard", "ep", "tp", "pp")
LAYOUTS = {  # [parallel] settings: the axes' sizes, and how the experts' tokens travel
    "ep2": {"ep": 2},
    "ep4": {"ep": 4},
    # a buffer of half the mean rows: the first evaluation and some steps overflow, computed again with larger ones
    "ep4-small-buffer": {"ep": 4, "ep_capacity": 0.5},
    "ep2-all_to_all": {"ep": 2, "ep_dispatch": "all_to_all"},
    "tp2": {"tp": 2},
    "ep2-tp2": {"ep": 2, "tp": 2},
    "dp_shard2": {"dp_shard": 2},
}


def launched(layout: dict) -> int:
    return math.prod(size for axis, size in layout.items() if axis in AXES)


def train_args(config_file, layout: dict, run_dir) -> list[str]:
    """`moemesh train` of the reference's config in `layout`, checkpoints at step 3 and the end."""
    parallel = [f"parallel.{axis}={size}" for axis, size in layout.items()]
    return ["-m", "moemesh", "train", "--config", str(config_file), "--set", *OVERRIDES, *parallel,
            f"train.run_dir={run_dir}", "train.save_every=3"]  # fmt: skip


@pytest.fixture(scope="module")
def layout_runs(reference):
    """The reference's run under torchrun in a layout, once per layout for the module, with
    checkpoints at step 3 and at the end (train.save_every=3: writing one changes no number), so
    that test_parallel_resume_continues_exactly resumes a copy of it instead of training it again."""
    config_file, _ = reference
    runs = {}

    def run(layout: dict):
        name = "-".join(f"{key}{value}" for key, value in layout.items())
        if name not in runs:
            run_dir = config_file.parent / name
            result = torchrun(launched(layout), *train_args(config_file, layout, run_dir))
            runs[name] = result, run_dir
        return runs[name]

    return run


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_parallel_training_equals_one_process(reference, layout_runs, layout):
    config_file, single_dir = reference
    result, run_dir = layout_runs(layout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if layout.get("ep_capacity", 1) < 1:
        assert "computed again: an expert-parallel buffer was full (layer " in result.stdout, result.stdout
    # parameter counts (and so MFU) are those of the whole model, not of one rank's experts
    model = load_config(config_file, OVERRIDES).model
    full = build(model)
    assert (
        f"{format_count(full.num_params())} parameters, {format_count(full.num_params(active=True))} active"
        in result.stdout
    )
    ours = [r for r in metrics(run_dir) if "loss" in r]
    theirs = [r for r in metrics(single_dir) if "loss" in r]
    assert len(ours) == len(theirs) == STEPS
    for a, b in zip(ours, theirs):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), (a["step"], key, a[key], b[key])
        loads = {key: value for key, value in b.items() if key.startswith("expert_load")}  # summed exactly
        assert loads and {key: value for key, value in a.items() if key.startswith("expert_load")} == loads
    final_val = [r["val_loss"] for r in metrics(run_dir) if "val_loss" in r][-1]
    assert abs(final_val - [r["val_loss"] for r in metrics(single_dir) if "val_loss" in r][-1]) <= 1e-4
    # the sharded checkpoint loads whole into one process
    sharded, _ = load_model(run_dir)
    whole, _ = load_model(single_dir)
    for (name, p), q in zip(sharded.state_dict().items(), whole.state_dict().values()):
        assert p.shape == q.shape and ((p - q).norm() / q.norm()).item() <= 1e-5, name


def test_a_dead_rank_stops_the_others_instead_of_hanging(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from moemesh.parallel.mesh import ParallelDims, init_mesh\n"
        "mesh = init_mesh(ParallelDims(ep=2), timeout_s=20)\n"
        "if dist.get_rank() == 1:\n"
        "    os._exit(3)  # dies without a word to its peer\n"
        "dist.all_reduce(torch.ones(1))  # rank 0 waits for a peer that is gone\n"
    )
    started = time.monotonic()
    result = torchrun(2, str(script), timeout=120)
    assert result.returncode != 0
    assert time.monotonic() - started < 90


RESUMED = {
    "parallel.ep=2": LAYOUTS["ep2"],
    "parallel.tp=2": LAYOUTS["tp2"],
    "parallel.dp_shard=2": LAYOUTS["dp_shard2"],
}


@pytest.mark.parametrize("layout", RESUMED)
def test_parallel_resume_continues_exactly(reference, layout_runs, tmp_path, layout):
    """Stop a 2-process run after its step-3 checkpoint (simulated by removing what came later
    from a copy of the layout's run) and resume it in the same layout: steps 4 and 5 are those of
    the uninterrupted single-process run (so the sharded weights and AdamW moments came back in
    place)."""
    config_file, single_dir = reference
    straight, straight_dir = layout_runs(RESUMED[layout])
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    run_dir = tmp_path / "resumed"
    shutil.copytree(straight_dir, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{STEPS}")
    result = torchrun(2, *train_args(config_file, RESUMED[layout], run_dir), "train.resume=true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "resumed from" in result.stdout
    ours = [r for r in metrics(run_dir) if "loss" in r]
    theirs = [r for r in metrics(single_dir) if "loss" in r]
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])


def test_pipeline_with_bf16_weights_tracks_one_process(reference, tmp_path):
    """train.param_dtype=bfloat16 under parallel.pp=2 (DualPipeV): the fp32 messages are cast back
    to the bf16 residual stream, so each stage computes what one process computes. Tolerance 1e-2
    relative: bf16 keeps 8 significant bits and the pipeline accumulates in another order."""
    config_file, _ = reference
    bf16 = [*OVERRIDES, "train.param_dtype=bfloat16", "train.micro_batch=2"]  # 4 micro-batches
    single, piped = tmp_path / "single", tmp_path / "pp2"
    train(load_config(config_file, [*bf16, f"train.run_dir={single}"]))
    result = torchrun(
        2,
        "-m",
        "moemesh",
        "train",
        "--config",
        str(config_file),
        "--set",
        *bf16,
        "parallel.pp=2",
        f"train.run_dir={piped}",
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ours, theirs = ([r for r in metrics(d) if "loss" in r] for d in (piped, single))
    assert len(ours) == len(theirs) == STEPS
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-2 * abs(b["loss"]), (a["step"], a["loss"], b["loss"])
