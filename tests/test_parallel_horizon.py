"""Every layout follows one process over a whole run — through the warm-up and deep into the cosine
decay, weight decay on — on 4 CPU processes (gloo), in fp32.

Two checks per layout, because training is chaotic: two runs that differ by one rounding (one
process on 1 thread against 2, or any two layouts) stay within 1e-6 for a dozen steps, then drift
apart by ~1e-3 as a router's top-k choice flips for a token near a tie and the difference grows
from there. A free-running curve can therefore only be compared against that drift, which hides
an error of the same size; the step itself can be compared exactly.

1. The same step. From one process's checkpoint at steps 2 (inside the warm-up), 12 (past it) and
   30 (in the decay), one optimizer step in the layout gives one process's loss, load-balancing
   loss and gradient norm, and after the step every weight, AdamW moment and step count, the
   scheduler, the data position and (for DeepSeek-V3) every router correction bias, at 1e-5
   relative: the same fp32 terms summed in another order. A layout that decayed, clipped,
   scheduled or balanced differently would be off by about lr × weight_decay = 1e-3 in the first
   step it did so. Then one more step from the layout's own checkpoint: one process's checkpoint
   loaded into the layout, and the layout's saved and loaded again, keep the optimizer state
   across changes of layout. (Not from step 0: AdamW's first update is g / |g| per element, which
   turns the rounding noise of a gradient element near zero into an update of ±lr.)
2. The same curve (Qwen3). STEPS free-running steps from the seed: each loss stays within DRIFT_MULTIPLE ×
   the largest drift of dp_replicate=4 — the pure rounding of data parallelism — up to that step,
   or within FLIP relative, whichever is larger. FLIP is what one token's top-k flip moves the
   loss by: measured at most 1.1e-4 (tp=4, step 21, back to 4e-6 by step 40), while a layout
   that skipped the weight decay of its experts is off by 1.5e-3 at step 20 and 4.5e-3 at step 40.
   Not for DeepSeek-V3: its balancing moves an expert's bias by ±rate on the sign of an integer
   load difference, so one token's flip moves a whole bias, and its free-running curves part by
   ~1e-3 within 25 steps whatever the layout; the same step (1.) covers its router biases exactly,
   so its layouts run only the forced steps, and its reference only as far as they reach.
"""

import io
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from moemesh.checkpoint.dcp import checkpoint_path
from moemesh.config import config_from_dict
from moemesh.train.trainer import Trainer
from numerics import rel_err
from test_train_router_bias import MODEL as DEEPSEEK_V3_MODEL
from tiny_run import tiny_raw, write_corpus

WORLD = 4
RTOL = 1e-5
STEPS = 40  # 5 warm-up steps, then 35 of cosine decay
FORCED = (2, 12, 30)  # the steps whose checkpoint each layout takes one step from
FREE_RUNNING = {"qwen3": STEPS, "deepseek_v3": 0}  # the free-running steps a layout's curve is compared over
DRIFT_MULTIPLE = 8
FLIP = 5e-4

TRAIN = {
    "steps": STEPS,
    "warmup_steps": 5,
    "lr": 1e-2,
    "weight_decay": 0.1,
    "global_batch": 16,
    "micro_batch": 4,
    "eval_every": 0,
    "save_every": -1,
    "router_bias_update_rate": 1e-3,
}
MODELS = {
    "qwen3": {"num_experts": 8, "num_experts_per_tok": 3, "num_key_value_heads": 4},
    "deepseek_v3": DEEPSEEK_V3_MODEL,  # MLA, shared experts, the auxiliary-loss-free router bias
}
LAYOUTS = {
    "dp_replicate4": dict(dp_replicate=4),
    "dp_shard4": dict(dp_shard=4),
    "ep4": dict(ep=4),
    "tp4": dict(tp=4),
    "ep2-tp2": dict(ep=2, tp=2),
    "dp_shard2-ep2": dict(dp_shard=2, ep=2),
    "dp_shard2-tp2": dict(dp_shard=2, tp=2),
    "hsdp2x2": dict(dp_replicate=2, dp_shard=2),
    "pp2-ep2": dict(pp=2, ep=2),
    "pp2-tp2": dict(pp=2, tp=2),
    "pp2-dp_shard2": dict(pp=2, dp_shard=2),
    "pp2-dp_replicate2": dict(pp=2, dp_replicate=2),
}
CASES = [("qwen3", name) for name in LAYOUTS] + [
    ("deepseek_v3", name) for name in ("ep2-tp2", "dp_shard2-ep2", "pp2-ep2")
]


def run_config(directory: Path, family: str, layout: str) -> dict:
    raw = tiny_raw(directory / family / layout, directory / "corpus.txt", **TRAIN)
    if family == "qwen3":
        raw["model"].update(MODELS[family])
    else:
        raw["model"] = dict(MODELS[family])
    raw["parallel"] = LAYOUTS.get(layout, {})
    return raw


def whole_state(checkpoint: Path) -> dict:
    """Everything a checkpoint holds, every tensor whole (DCP gathers the layout's pieces)."""
    target = checkpoint.with_name(checkpoint.name + ".pt")
    dcp_to_torch_save(checkpoint, target)
    return torch.load(target, weights_only=False)


def assert_same_state(ours, theirs, where: str = "") -> None:
    if isinstance(theirs, dict):
        assert ours.keys() == theirs.keys(), where
        for key in theirs:
            if where.startswith("/optimizer/param_groups") and key == "params":
                continue  # the names of the saving rank's parameters: a pipeline rank lists its own
            assert_same_state(ours[key], theirs[key], f"{where}/{key}")
    elif isinstance(theirs, torch.Tensor) and theirs.is_floating_point():
        assert rel_err(ours, theirs) <= RTOL, where
    elif isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs), where
    elif isinstance(theirs, float):
        assert abs(ours - theirs) <= RTOL * abs(theirs), (where, ours, theirs)
    elif isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_state(a, b, f"{where}/{i}")
    else:
        assert ours == theirs, (where, ours, theirs)


def assert_same_record(ours: dict, theirs: dict, tolerance: float = RTOL) -> None:
    for key in ("loss", "aux_loss", "grad_norm"):
        assert abs(ours[key] - theirs[key]) <= tolerance * abs(theirs[key]), (key, ours[key], theirs[key])


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Per family, one process on one thread (as each rank runs): the records of every step and a
    checkpoint before and after each forced step."""
    directory = tmp_path_factory.mktemp("horizon")
    write_corpus(directory)
    cache = {}

    def reference(family: str):
        if family not in cache:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                trainer = Trainer(config_from_dict(run_config(directory, family, "one-process")), io.StringIO())
                records = []
                for step in range(max(FREE_RUNNING[family], FORCED[-1] + 3)):
                    if any(0 <= step - forced <= 2 for forced in FORCED):
                        trainer.save()
                    records.append(trainer.train_step())
            finally:
                torch.set_num_threads(threads)
            cache[family] = directory, records, trainer.run_dir
        return cache[family]

    return reference


def layout_run(rank, raw: dict, reference_run: str, free_steps: int) -> tuple[list[dict], list[dict]]:
    """`free_steps` free-running steps; then, for each forced step s, one step from the reference's
    checkpoint s, saved as the layout's checkpoint s + 1, and one step from that, saved as s + 2.
    One trainer does it all (each trainer makes its own process groups)."""
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    free_records = [trainer.train_step() for _ in range(free_steps)]
    forced_records = []
    for step in FORCED:
        trainer.run_dir = Path(raw["train"]["run_dir"]) / f"from_{step}"
        for restore in (checkpoint_path(reference_run, step), checkpoint_path(trainer.run_dir, step + 1)):
            trainer.restore(restore)
            forced_records.append(trainer.train_step())
            trainer.save()
    return free_records, forced_records


@pytest.fixture(scope="module")
def drift(pool, references):
    """Per family: dp_replicate=4's largest |loss − one process| up to each step (the rounding of
    data parallelism, amplified as training goes), and its run's records."""
    cache = {}

    def envelope(family: str) -> list[float]:
        if family not in cache:
            directory, records, reference_run = references(family)
            runs = pool.run(
                layout_run, run_config(directory, family, "dp_replicate4"), str(reference_run), FREE_RUNNING[family]
            )
            free, _ = runs[0]
            largest, bound = 0.0, []
            for ours, theirs in zip(free, records):
                largest = max(largest, abs(ours["loss"] - theirs["loss"]))
                bound.append(largest)
            cache[family] = bound, runs
        return cache[family]

    return envelope


@pytest.mark.parametrize("family, layout", CASES, ids=[f"{f}-{name}" for f, name in CASES])
def test_layout_follows_one_process_over_the_run(pool, references, drift, family, layout):
    directory, records, reference_run = references(family)
    bound, replicate_runs = drift(family) if FREE_RUNNING[family] else (None, None)
    runs = (
        replicate_runs
        if layout == "dp_replicate4"
        else pool.run(layout_run, run_config(directory, family, layout), str(reference_run), FREE_RUNNING[family])
    )
    for free, forced in runs:  # every rank reports the same figures
        for step, forced_record in zip([s + i for s in FORCED for i in (0, 1)], forced, strict=True):
            assert_same_record(forced_record, records[step])
        if not FREE_RUNNING[family] or layout == "dp_replicate4":  # dp_replicate4's own drift is the bound
            continue
        for step, (ours, theirs) in enumerate(zip(free, records, strict=True), start=1):
            allowed = max(FLIP * abs(theirs["loss"]), DRIFT_MULTIPLE * bound[step - 1])
            assert abs(ours["loss"] - theirs["loss"]) <= allowed, (step, ours["loss"], theirs["loss"], allowed)
    layout_dir = Path(run_config(directory, family, layout)["train"]["run_dir"])
    for forced in FORCED:
        for step in (forced + 1, forced + 2):
            ours = whole_state(checkpoint_path(layout_dir / f"from_{forced}", step))
            assert_same_state(ours, whole_state(checkpoint_path(reference_run, step)))
