"""A CPU run's thread count: the cores idle at its start (read from /proc/stat), within torch's
default, shared by a machine's ranks; train.threads or OMP_NUM_THREADS instead; said in the run's
first lines, and torch's count restored after."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from moemesh.config import load_config
from moemesh.errors import ConfigError
from moemesh.train import threads, trainer
from moemesh.train.metrics import read_metrics
from moemesh.train.threads import choose_threads, cpu_threads, idle_cores
from tiny_run import tiny_config, write_corpus


def _stat(ticks: dict[int, tuple[int, int]]) -> str:
    """A /proc/stat of CPUs with (busy, idle) ticks (the idle split between idle and iowait)."""
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, (busy, idle) in ticks.items():
        lines.append(f"cpu{cpu} {busy} 0 0 {idle - idle // 4} {idle // 4} 0 0 0 0 0")
    return "\n".join([*lines, "intr 1 2 3", "ctxt 5"]) + "\n"


def test_idle_cores_are_summed_from_the_kernels_counters(tmp_path, monkeypatch):
    """Two samples of the per-CPU counters: a core busy throughout counts 0, an idle one 1, one
    busy a quarter of the time 0.75; a CPU outside the process's affinity is not counted."""
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    samples = iter(
        [
            _stat({0: (100, 100), 1: (100, 100), 2: (100, 100), 3: (0, 0)}),
            _stat({0: (200, 100), 1: (100, 200), 2: (125, 175), 3: (0, 100)}),
        ]
    )
    stat = tmp_path / "stat"

    def sleep(seconds):
        stat.write_text(next(samples))

    stat.write_text(next(samples))
    monkeypatch.setattr(threads.time, "sleep", sleep)
    assert idle_cores(stat_path=str(stat)) == pytest.approx(1.75)
    assert idle_cores(stat_path=str(tmp_path / "missing")) is None


def test_the_count_follows_the_idle_cores_within_torchs_default(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert choose_threads(measure=lambda: 1.2).count == 1  # one core of two busy: one thread
    assert choose_threads(measure=lambda: 0.1).count == 1  # every core busy: still one
    assert choose_threads(measure=lambda: 5.6).count == 6
    assert choose_threads(measure=lambda: 63.0).count == 8  # never more than torch's default
    shared = choose_threads(local_ranks=4, measure=lambda: 8.0)
    assert shared.count == 2 and "shared by 4 processes" in shared.why
    assert "idle at the start" in choose_threads(measure=lambda: 1.2).why
    unknown = choose_threads(measure=lambda: None)  # no /proc/stat: torch's default
    assert unknown.count == 8 and "torch's default" in unknown.why
    assert choose_threads(3, measure=lambda: 1.0) == threads.Threads(3, "train.threads", chosen_here=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert choose_threads(measure=lambda: 1.0) == threads.Threads(
        8, "OMP_NUM_THREADS", chosen_here=False
    )  # torch read it
    assert choose_threads(2, measure=lambda: 1.0).count == 2  # train.threads first


def test_a_run_says_its_threads_and_restores_torchs(tmp_path, monkeypatch):
    """train.threads=1: the steps run on one thread, the first lines say so, and torch's count
    is what it was after the run."""
    before = torch.get_num_threads()
    seen = []
    real_step = trainer.Trainer.train_step

    def train_step(self):
        seen.append(torch.get_num_threads())
        return real_step(self)

    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    stream = io.StringIO()
    trainer.train(tiny_config(tmp_path / "run", write_corpus(tmp_path), steps=2, threads=1), stream=stream)
    first_lines = stream.getvalue().splitlines()[:3]
    assert any("on cpu (1 thread: train.threads) in float32" in line for line in first_lines), first_lines
    assert seen == [1, 1] and torch.get_num_threads() == before


def test_train_threads_must_not_be_negative():
    with pytest.raises(ConfigError, match="train.threads must be >= 0, got -1"):
        load_config(None, ["train.threads=-1"])
    with pytest.raises(ConfigError, match=r"did you mean 'train.threads'"):
        load_config(None, ["train.num_threads=2"])


def test_a_gpu_run_leaves_threads_alone():
    before = torch.get_num_threads()
    with cpu_threads(torch.device("cuda"), 1) as chosen:
        assert chosen is None and torch.get_num_threads() == before


def _losses(run) -> list[tuple]:
    return [
        (r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in read_metrics(run / "metrics.jsonl")
    ]


def test_a_resumed_run_computes_on_the_threads_of_the_run_it_resumes(tmp_path, monkeypatch):
    """A checkpoint records its thread count; resumed where the machine's load would choose
    another, the run takes the checkpoint's (a loss's last bits depend on it) and says so; with
    train.threads set to another, it says that the losses may differ in the last bits."""
    counts, seen = iter([1, 2, 2]), []
    monkeypatch.setattr(
        threads,
        "choose_threads",
        lambda requested=0, local_ranks=1: threads.Threads(
            requested or next(counts), "chosen", chosen_here=not requested
        ),
    )
    real_step = trainer.Trainer.train_step
    monkeypatch.setattr(
        trainer.Trainer, "train_step", lambda self: seen.append(torch.get_num_threads()) or real_step(self)
    )
    corpus = write_corpus(tmp_path)
    run = tmp_path / "run"
    trainer.train(tiny_config(run, corpus, steps=4, save_every=2, keep_checkpoints=0), stream=io.StringIO())
    uninterrupted = _losses(run)
    shutil.rmtree(run / "checkpoints" / "step_4")
    stream = io.StringIO()
    trainer.train(tiny_config(run, corpus, steps=4, save_every=2, resume=True), stream=stream)
    assert "threads 1: the resumed run's, to reproduce its losses exactly" in stream.getvalue(), stream.getvalue()
    assert seen == [1, 1, 1, 1, 1, 1]
    assert _losses(run) == uninterrupted
    shutil.rmtree(run / "checkpoints" / "step_4")
    stream = io.StringIO()
    trainer.train(tiny_config(run, corpus, steps=4, save_every=2, resume=True, threads=2), stream=stream)
    assert "the run it resumes computed on 1, so its losses from here may differ" in stream.getvalue()
    assert seen[-2:] == [2, 2]
