"""Faults, injected on CPU, and what survives them:

- `kill -9` at seeded random points of training and saving (`kill_point.py`), each run resumed:
  the losses, learning rates, gradient norms, validation losses and final weights are bitwise those
  of an uninterrupted run, and nothing half-written is left;
- a corrupted, truncated or incomplete newest checkpoint: resume, `generate` and `convert` fall
  back to the previous one and name the one they skipped; asked for by name, it is refused;
- a diverging run (`train.lr=1e3 train.grad_clip=0`) skips its non-finite steps, stops after
  `train.max_bad_steps` in a row with one line naming the step, and leaves no non-finite checkpoint;
  a skipped step changes nothing but the data position, and the decision is the same on every rank
  of every layout, with the bad value on one rank only;
- a rerun without `train.resume` deletes nothing; `train.overwrite` does; retention keeps N and
  never the half-deleted; files and directories are flushed to disk before a checkpoint is published;
- under torchrun, a config error is said once, and a stopped rank fails its peers after
  `parallel.timeout_s` with one line.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import moemesh.train.trainer as trainer_module
from moemesh.checkpoint.dcp import checkpoint_path, latest_checkpoint, prune_checkpoints
from moemesh.checkpoint.load import load_model
from moemesh.cli import main
from moemesh.config import config_from_dict, load_config
from moemesh.errors import CheckpointError, ConfigError, DivergedError
from moemesh.train.metrics import read_metrics
from moemesh.train.trainer import Trainer, train
from test_parallel_train import torchrun
from tiny_run import tiny_config, tiny_raw, write_corpus, write_tiny_toml

WORLD = 2  # the `pool` fixture's processes
TESTS = Path(__file__).resolve().parent
COMPARED = ("step", "loss", "aux_loss", "lr", "grad_norm", "val_loss")


@pytest.fixture(autouse=True)
def corpus(tmp_path):
    return write_corpus(tmp_path)


def _curve(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(run_dir / "metrics.jsonl")]


def _python_started(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{TESTS.parent}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _finished(process: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return _finished(_python_started(*args), timeout)


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_model(checkpoint)[0].state_dict()


# ---- kill -9 ---------------------------------------------------------------------------------------

KILL_POINTS = ("step", "metrics", "dcp_data", "checksums", "publish", "published", "prune")
KILL_RUN = ["train.steps=24", "train.save_every=4", "train.keep_checkpoints=2", "train.eval_every=6"]


def test_kill_9_anywhere_then_resume_equals_an_uninterrupted_run(tmp_path):
    """Seven processes killed in turn, each at one of the points in a seeded random order and at its
    first or second occurrence (each resuming what the last one left),
    then one that finishes: every figure of every step, and the final weights, are bitwise those of
    a run that was never interrupted; the run directory holds the two newest checkpoints, no more."""
    config = write_tiny_toml(tmp_path)
    # the uninterrupted run beside the interrupted ones (one thread each): a process of its own
    straight = _python_started(
        "-m", "moemesh", "train", "--config", str(config), "--set", *KILL_RUN, f"train.run_dir={tmp_path / 'straight'}"
    )
    try:
        rng = random.Random(20)
        plan = [(point, rng.randint(1, 2)) for point in rng.sample(KILL_POINTS, len(KILL_POINTS))]
        run = [
            "train",
            "--config",
            str(config),
            "--set",
            *KILL_RUN,
            f"train.run_dir={tmp_path / 'killed'}",
            "train.resume=true",
        ]
        for point, nth in plan:
            killed = _python(str(TESTS / "kill_point.py"), point, str(nth), *run)
            assert killed.returncode == -signal.SIGKILL, (point, nth, killed.returncode, killed.stderr[-2000:])
            assert killed.stderr == "", (point, killed.stderr)  # no error, no traceback: it just died
        finished = _python("-m", "moemesh", *run)
        assert finished.returncode == 0, finished.stderr[-2000:]
        assert finished.stderr == ""  # nothing was skipped: every published checkpoint verifies
        straight_result = _finished(straight)
    finally:
        if straight.poll() is None:  # a failure above: not left running
            straight.kill()
            straight.communicate()
    assert straight_result.returncode == 0, straight_result.stderr[-2000:]

    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"
    assert _curve(killed_dir) == _curve(straight_dir)
    assert [r["step"] for r in read_metrics(killed_dir / "metrics.jsonl")] == list(range(25))
    assert sorted(p.name for p in (killed_dir / "checkpoints").iterdir()) == ["step_20", "step_24"]
    ours, theirs = _weights(killed_dir / "checkpoints" / "step_24"), _weights(straight_dir / "checkpoints" / "step_24")
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


# ---- corrupted checkpoints ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run of 20 steps with checkpoints at steps 10 and 20."""
    directory = tmp_path_factory.mktemp("trained")
    train(tiny_config(directory / "run", write_corpus(directory)), stream=io.StringIO())
    return directory / "run"


def _data_file(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


CORRUPTIONS = {
    "a flipped bit": (
        lambda c: _flip_a_byte(_data_file(c)),
        lambda c: f"is corrupted ({_data_file(c).name} does not match its SHA-256 in SHA256SUMS)",
    ),
    "a truncated file": (
        lambda c: os.truncate(_data_file(c), 1000),
        lambda c: f"is not a complete checkpoint ({_data_file(c).name} is missing or truncated)",
    ),
    "no .metadata": (lambda c: (c / ".metadata").unlink(), lambda c: "is not a complete checkpoint (no .metadata)"),
    "a changed config.json": (
        lambda c: (c / "config.json").write_text("{}"),
        lambda c: "is corrupted (config.json does not match its SHA-256 in SHA256SUMS)",
    ),
    "a garbled SHA256SUMS": (
        lambda c: (c / "SHA256SUMS").write_text("garbage\n"),
        lambda c: "is corrupted (SHA256SUMS line 1 is not '<sha256>  <file>')",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS, ids=CORRUPTIONS)
def test_a_damaged_newest_checkpoint_is_skipped_with_its_reason(tmp_path, trained, corruption):
    damage, reason = CORRUPTIONS[corruption]
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest = run_dir / "checkpoints" / "step_20"
    expected = reason(newest)
    damage(newest)
    lines = []
    assert latest_checkpoint(run_dir, report=lines.append) == run_dir / "checkpoints" / "step_10"
    assert lines == [f"skipping {newest}, which {expected}"]


def test_resume_generate_and_convert_fall_back_from_a_corrupted_checkpoint(tmp_path, trained, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    newest, previous = run_dir / "checkpoints" / "step_20", run_dir / "checkpoints" / "step_10"
    _flip_a_byte(_data_file(newest))
    skipped = f"moemesh: skipping {newest}, which is corrupted ({_data_file(newest).name} does not match its SHA-256"

    # asked for by name, it is refused; through the run directory, the previous one answers
    assert main(["generate", "--checkpoint", str(newest), "--prompt", "def "]) == 2
    assert capsys.readouterr().err == (
        f"moemesh generate: error: {newest} is corrupted ({_data_file(newest).name} "
        "does not match its SHA-256 in SHA256SUMS)\n"
    )
    args = ["--prompt", "def ", "--max-new-tokens", "20"]
    assert main(["generate", "--checkpoint", str(previous), *args]) == 0
    expected = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(run_dir), *args]) == 0
    out, err = capsys.readouterr()
    assert out == expected and err.startswith(skipped) and err.count("\n") == 1
    assert main(["convert", str(run_dir), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert f"from {previous}" in out and err.startswith(skipped)

    # resume: from step 10, steps 11..20 again, the same figures; the corrupted step_20 is replaced
    stream = io.StringIO()
    result = train(tiny_config(run_dir, tmp_path / "corpus.txt", resume=True), stream=stream)
    said = stream.getvalue()
    assert f"skipping {newest}, which is corrupted" in said and f"resumed from {previous} (step 10)" in said
    assert _curve(result.run_dir) == _curve(trained)
    assert latest_checkpoint(run_dir) == newest
    for name, tensor in _weights(trained / "checkpoints" / "step_20").items():
        assert torch.equal(_weights(newest)[name], tensor), name


def test_resume_refuses_when_no_checkpoint_verifies(tmp_path, trained):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    for step in (10, 20):
        (checkpoint_path(run_dir, step) / ".metadata").unlink()
    lines = io.StringIO()
    with pytest.raises(
        CheckpointError, match="train.resume: none of the 2 checkpoints in .* verifies .*train.overwrite=true"
    ):
        train(tiny_config(run_dir, tmp_path / "corpus.txt", resume=True), stream=lines)
    assert lines.getvalue().count("skipping") == 2
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_10", "step_20"]


# ---- divergence --------------------------------------------------------------------------------------


def test_a_diverging_run_stops_and_leaves_no_non_finite_checkpoint(tmp_path, capsys):
    config = write_tiny_toml(tmp_path, steps=40, save_every=2, keep_checkpoints=0, log_every=1)
    assert main(["train", "--config", str(config), "--set", "train.lr=1e3", "train.grad_clip=0"]) == 2
    out, err = capsys.readouterr()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    skipped = [r["step"] for r in records if r.get("skipped")]
    last = records[-1]["step"]
    assert skipped[-3:] == [last - 2, last - 1, last] and last < 40  # three in a row, then it stopped
    assert err.count("\n") == 1 and err.startswith(f"moemesh train: error: step {last}: ")
    assert "3 steps in a row without an update (train.max_bad_steps): the run diverged" in err
    for step in skipped:
        assert f"step {step}: skipped, " in out
        record = records[step]
        assert not all(isinstance(record[k], float) for k in ("loss", "grad_norm"))  # a non-finite one is null
    json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])  # strict JSON
    checkpoints = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert checkpoints and all(int(p.name[5:]) < last for p in checkpoints)
    for checkpoint in checkpoints:
        assert all(t.isfinite().all() for t in _weights(checkpoint).values()), checkpoint.name


def _poison_step(monkeypatch, step: int, rank: int = 0):
    """On `rank`, make one gradient non-finite in optimizer step `step` (counted from 1), before the
    gradients are reduced, as a bad batch would."""
    real, calls = trainer_module.reduce_gradients, [0]

    def poisoned(model, mesh):
        calls[0] += 1
        if calls[0] == step and int(os.environ.get("RANK", "0")) == rank:
            param = next(p for p in model.parameters() if p.grad is not None)
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad.view(-1)[0] = float("nan")
        real(model, mesh)

    monkeypatch.setattr(trainer_module, "reduce_gradients", poisoned)


def test_the_count_of_skipped_steps_survives_a_resume(tmp_path, monkeypatch):
    """Steps 2 and 3 skipped, a checkpoint at step 3, a resume, step 4 skipped: three in a row
    (train.max_bad_steps), so the resumed run stops there, as the uninterrupted one would."""
    config = dict(steps=3, save_every=3, max_bad_steps=3)
    for step in (2, 3):
        _poison_step(monkeypatch, step)
    Trainer(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", **config), io.StringIO()).run()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("skipped")] == [2, 3]
    monkeypatch.undo()

    _poison_step(monkeypatch, 1)  # the first step of the resumed process: step 4
    stream = io.StringIO()
    resumed = tiny_config(tmp_path / "run", tmp_path / "corpus.txt", **{**config, "steps": 6}, resume=True)
    with pytest.raises(DivergedError, match="step 4: .*3 steps in a row without an update"):
        Trainer(resumed, stream).run()
    assert "step 4: skipped, gradient norm nan: no update (3 in a row; train.max_bad_steps=3)" in stream.getvalue()


def _snapshot(trainer: Trainer) -> dict:
    return {
        "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": {
            n: {k: v.clone() if torch.is_tensor(v) else v for k, v in trainer.optimizer.state[p].items()}
            for n, p in trainer.model.named_parameters()
            if p in trainer.optimizer.state
        },
        "lr": trainer.scheduler.get_last_lr()[0],
        "scheduler_step": trainer.scheduler.last_epoch,
    }


def test_a_skipped_step_changes_nothing_but_the_data_position(tmp_path, monkeypatch):
    config = tiny_config(tmp_path / "run", tmp_path / "corpus.txt", steps=6)
    trainer = Trainer(config, io.StringIO())
    _poison_step(monkeypatch, step=3)
    trainer.train_step(), trainer.train_step()
    before = _snapshot(trainer)
    record = trainer.train_step()
    after = _snapshot(trainer)
    assert record["skipped"] is True and math.isnan(record["grad_norm"]) and math.isfinite(record["loss"])
    assert trainer.step == 3 and trainer.data_position == 3 * config.train.global_batch
    for name, weight in before["weights"].items():
        assert torch.equal(after["weights"][name], weight), name
    for name, state in before["optimizer"].items():  # AdamW's moments and its step count
        for key, value in state.items():
            assert torch.equal(after["optimizer"][name][key], value), (name, key)
    assert after["lr"] == before["lr"] and after["scheduler_step"] == before["scheduler_step"]
    assert record["lr"] == before["lr"]
    assert trainer.train_step()["lr"] == before["lr"]  # the schedule counts updates: step 4 takes step 3's rate
    assert "skipped" not in trainer.train_step()


def test_non_finite_weights_are_never_saved(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run", tmp_path / "corpus.txt"), io.StringIO())
    trainer.train_step()
    trainer.save()
    with torch.no_grad():
        trainer.model.lm_head.weight[0, 0] = float("inf")
    trainer.train_step()
    with pytest.raises(
        DivergedError,
        match=r"step 2: the weights hold non-finite values, so no checkpoint is "
        r"written; the newest checkpoint is .*step_1",
    ):
        trainer.save()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_1"]


def _skips_under_layout(rank: int, raw: dict, directory: str) -> dict:
    """Three steps of a layout with rank 1's gradient poisoned in step 2: what each rank decided,
    and whether its weights moved in each step."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        _poison_step(monkeypatch, step=2, rank=1)
        trainer = Trainer(config_from_dict(raw), io.StringIO())
        decisions, moved = [], []
        for _ in range(3):
            before = [p.detach().clone() for p in trainer.model.parameters()]
            decisions.append(bool(trainer.train_step().get("skipped")))
            moved.append(any(not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before)))
        return {"skipped": decisions, "moved": moved}
    finally:
        monkeypatch.undo()


LAYOUTS = {
    "dp_replicate2": {"dp_replicate": 2},
    "dp_shard2": {"dp_shard": 2},
    "ep2": {"ep": 2},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
}


def test_every_rank_of_every_layout_skips_the_same_step(pool, tmp_path):
    """A NaN in one gradient of rank 1 only (before the gradients are reduced) makes every rank of
    every layout skip that step and only that one: the decision comes from the loss and gradient
    norm, which every rank holds summed over the ranks."""
    write_corpus(tmp_path)
    for name, layout in LAYOUTS.items():
        raw = tiny_raw(tmp_path / name, tmp_path / "corpus.txt", steps=3, global_batch=8, micro_batch=2)
        raw["parallel"] = layout
        for outcome in pool.run(_skips_under_layout, raw, str(tmp_path)):
            assert outcome == {"skipped": [False, True, False], "moved": [True, False, True]}, (name, outcome)


# ---- the run directory -------------------------------------------------------------------------------


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_rerun_without_resume_deletes_nothing(tmp_path, capsys, monkeypatch):
    config = write_tiny_toml(tmp_path, steps=10, save_every=5)
    assert main(["train", "--config", str(config)]) == 0
    checkpoints = tmp_path / "run" / "checkpoints"
    before = _files(checkpoints)
    capsys.readouterr()
    with monkeypatch.context() as patch:  # refused before the data or any weight is read
        reads = []
        for name in ("load_dataset", "materialize", "load_weights"):
            patch.setattr(f"moemesh.train.trainer.{name}", lambda *args, name=name, **kw: reads.append(name))
        assert main(["train", "--config", str(config)]) == 2
        assert reads == []
    assert capsys.readouterr().err == (
        f"moemesh train: error: {checkpoints} holds the checkpoints of an earlier run "
        "(the newest: step_10): train.resume=true continues that run, "
        "train.overwrite=true deletes them and starts afresh\n"
    )
    assert _files(checkpoints) == before

    assert main(["train", "--config", str(config), "--set", "train.overwrite=true", "train.steps=5"]) == 0
    assert "train.overwrite: deleting the earlier run's" in capsys.readouterr().out
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_5"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir() if p.name.startswith(".")) == []
    with pytest.raises(ConfigError, match="train.resume=true continues .* train.overwrite=true deletes it: choose one"):
        load_config(config, ["train.resume=true", "train.overwrite=true"])


def test_retention_keeps_the_newest(tmp_path):
    result = train(
        tiny_config(tmp_path / "run", tmp_path / "corpus.txt", save_every=2, keep_checkpoints=3), stream=io.StringIO()
    )
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step_16", "step_18", "step_20"]
    result = train(
        tiny_config(tmp_path / "all", tmp_path / "corpus.txt", steps=6, save_every=2, keep_checkpoints=0),
        stream=io.StringIO(),
    )
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]


def test_pruning_keeps_the_just_saved_one_and_newer_ones_it_cannot_trust(tmp_path):
    """After a resume from step 12 (steps 14 and 16 failed to verify), saving step 14 replaces the
    bad step 14, deletes below keep, keeps the unverified step 16 (the run will reach and replace
    it), and clears what interrupted saves and deletions left."""
    root = tmp_path / "checkpoints"
    for name in ["step_8", "step_10", "step_12", "step_14", "step_16", ".tmp-step_18", ".tmp-deleting-step_6"]:
        (root / name).mkdir(parents=True)
    prune_checkpoints(tmp_path, 2, root / "step_14")
    assert sorted(p.name for p in root.iterdir()) == ["step_12", "step_14", "step_16"]
    prune_checkpoints(tmp_path, 1, root / "step_14")
    assert sorted(p.name for p in root.iterdir()) == ["step_14", "step_16"]


def test_files_and_directories_reach_the_disk_before_a_checkpoint_is_published(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    result = train(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", steps=2, save_every=0), stream=io.StringIO())
    published = result.run_dir / "checkpoints" / "step_2"
    tmp = published.with_name(".tmp-step_2")
    at = events.index(("rename", str(tmp), str(published)))
    synced = set()  # a file fsynced under one name and then renamed (DCP's .metadata.tmp) keeps its data
    for event in events[:at]:
        if event[0] == "fsync":
            synced.add(event[1])
        elif event[1] in synced:
            synced.add(event[2])
    assert {str(tmp / p.name) for p in published.iterdir()} | {str(tmp)} <= synced
    assert ("fsync", str(published.parent)) in events[at:]


# ---- under torchrun ----------------------------------------------------------------------------------


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    config = write_tiny_toml(tmp_path)
    result = torchrun(2, "-m", "moemesh", "train", "--config", str(config), "--set", "parallel.ep=3", timeout=120)
    line = (
        "moemesh train: error: train.micro_batch (2) must be divisible by the data-parallel size "
        "(parallel.dp_replicate × parallel.dp_shard × parallel.ep = 3)"
    )
    assert result.stderr.startswith(line + "\n") and result.stderr.count(line) == 2  # and in torchrun's report:
    assert f"traceback : {line}" in result.stderr and "exitcode  : 2" in result.stderr
    assert result.returncode == 1  # torchrun's own, whatever its workers return


def _children(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children]


def _rank_of(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


def test_a_stopped_rank_fails_its_peers_after_the_timeout(tmp_path):
    """SIGSTOP rank 1 of a 2-process run once it trains: rank 0 says, in one line, that a collective
    timed out, parallel.timeout_s after rank 1 stopped (15 s: less fails spuriously on a loaded
    machine, where a step can take seconds). The stopped rank is then killed here: torchrun would
    SIGKILL it only 30 s after its SIGTERM, which a stopped process cannot act on."""
    config = write_tiny_toml(tmp_path, steps=2000, save_every=-1, eval_every=0, log_every=1)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "-m",
        "moemesh",
        "train",
        "--config",
        str(config),
        "--set",
        "parallel.dp_shard=2",
        "parallel.timeout_s=15",
    ]
    agent = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    try:
        for line in agent.stdout:  # "step   10/2000 loss ..."
            if (step := re.match(r"step +(\d+)/", line)) and int(step.group(1)) >= 10:
                break
        rank1 = next(pid for pid in _children(agent.pid) if _rank_of(pid) == 1)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        first = agent.stderr.readline()
        waited = time.monotonic() - stopped
        os.kill(rank1, signal.SIGKILL)
        agent.communicate(timeout=60)
    finally:
        agent.kill()
    assert re.fullmatch(
        r"moemesh train: error: rank 0: a collective failed: Timed out waiting 15000ms for (recv|send) "
        r"operation to complete \(a peer stopped, died or exceeded parallel.timeout_s\)\n",
        first,
    ), first
    assert 14 < waited < 40, waited
    assert agent.returncode == 1
