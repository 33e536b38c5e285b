"""The training loop: exact resume, crash-safe checkpoints, metrics, plot, and the arithmetic of
gradient accumulation and the schedule."""

from __future__ import annotations

import io
import math
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import moemesh.train.trainer as trainer_module
from moemesh.checkpoint.dcp import latest_checkpoint
from moemesh.checkpoint.load import load_model
from moemesh.config import TrainConfig, config_from_dict
from moemesh.errors import CheckpointError, ConfigError
from moemesh.models import build
from moemesh.train.flops import flops_per_token
from moemesh.train.metrics import read_metrics
from moemesh.train.optim import build_optimizer, lr_factor
from moemesh.train.trainer import train
from numerics import rel_err
from test_faults import _poison_step
from tiny_run import tiny_config, tiny_raw, write_corpus

COMPARED = ("loss", "aux_loss", "lr", "grad_norm", "val_loss")


def _run(tmp_path: Path, name: str, **train_overrides):
    return train(tiny_config(tmp_path / name, tmp_path / "corpus.txt", **train_overrides), stream=io.StringIO())


def _curve(run_dir: Path) -> list[dict]:
    return [{k: r.get(k) for k in ("step", *COMPARED)} for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.fixture(autouse=True)
def corpus(tmp_path):
    return write_corpus(tmp_path)


def _crash_after_saving(monkeypatch, step_name: str):
    """Make the run die (as if killed) right after it has written checkpoint `step_name`."""
    real_save = trainer_module.save_checkpoint

    def save_then_die(path, *args, **kwargs):
        real_save(path, *args, **kwargs)
        if path.name == step_name:
            raise KeyboardInterrupt

    monkeypatch.setattr(trainer_module, "save_checkpoint", save_then_die)


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, monkeypatch):
    straight = _run(tmp_path, "straight")

    _crash_after_saving(monkeypatch, "step_10")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "resumed")
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")] == list(range(11))
    resumed = _run(tmp_path, "resumed", resume=True)

    assert resumed.steps == straight.steps == 20
    expected = _curve(straight.run_dir)
    assert [r["step"] for r in expected] == list(range(21))
    assert _curve(resumed.run_dir) == expected  # bit-for-bit: losses, lr, grad norms, validation
    a, b = load_model(straight.checkpoint)[0], load_model(resumed.checkpoint)[0]
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_a_failed_save_leaves_nothing_behind_and_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    real_save = dcp.save

    def dies_while_writing(state, *, checkpoint_id, **kwargs):
        if Path(checkpoint_id).name.endswith("step_20"):
            (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(state, checkpoint_id=checkpoint_id, **kwargs)

    monkeypatch.setattr(dcp, "save", dies_while_writing)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*step_20: .*No space left on device"):
        _run(tmp_path, "run")
    monkeypatch.undo()

    run_dir = tmp_path / "run"
    assert latest_checkpoint(run_dir) == run_dir / "checkpoints" / "step_10"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_10"]
    model, source = load_model(run_dir)
    assert source.name == "step_10" and model.num_params() > 0

    result = _run(tmp_path, "run", resume=True)
    assert result.steps == 20
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_10", "step_20"]


def test_a_run_writes_metrics_plot_config_and_learns(tmp_path):
    result = _run(tmp_path, "run", steps=30, eval_every=15)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert records[0] == {"step": 0, "val_loss": result.first_val_loss}
    steps = records[1:]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for record in steps:
        for key in ("loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "max_memory_bytes"):
            assert isinstance(record[key], (int, float)) and math.isfinite(record[key]), key
        assert "mfu" not in record  # CPU: no peak to compare with
    assert [r["step"] for r in records if "val_loss" in r] == [0, 15, 30]
    assert result.first_val_loss > 5.0  # about ln(256) at initialisation
    assert result.last_val_loss < result.first_val_loss - 1.5
    assert 1.9 < steps[0]["aux_loss"] < 2.5  # perfectly balanced routing gives top_k = 2

    png = (result.run_dir / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    written = config_from_dict(tomllib.loads((result.run_dir / "config.toml").read_text()))
    assert written.train.steps == 30 and written.train.device == "cpu" and written.train.dtype == "float32"
    assert result.checkpoint == result.run_dir / "checkpoints" / "step_30"
    assert sorted(p.name for p in (result.run_dir / "checkpoints").iterdir()) == ["step_10", "step_20", "step_30"]


def test_resume_with_no_checkpoint_starts_at_step_zero(tmp_path):
    stream = io.StringIO()
    result = train(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", steps=3, resume=True), stream=stream)
    assert "no checkpoint" in stream.getvalue() and result.steps == 3


def test_micro_batch_split_does_not_change_the_step(tmp_path):
    # The same global batch in 1 or 4 micro-batches gives the same steps up to float rounding.
    # (Without the load-balancing loss: it is computed per micro-batch, so it depends on the split
    # by definition, though never on the parallel layout.)
    curves = []
    for micro_batch in (4, 1):
        raw = tiny_raw(tmp_path / f"mb{micro_batch}", tmp_path / "corpus.txt", steps=4, micro_batch=micro_batch)
        raw["model"]["output_router_logits"] = False
        curves.append(_curve(train(config_from_dict(raw), stream=io.StringIO()).run_dir))
    for curve in curves[1:]:
        for a, b in zip(curves[0], curve, strict=True):
            for key in COMPARED:
                assert (a[key] is None) == (b[key] is None)
                if a[key] is not None:
                    assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)


def test_schedule_warms_up_linearly_then_follows_a_cosine():
    train_config = TrainConfig(steps=110, warmup_steps=10, min_lr_ratio=0.1)
    factors = [lr_factor(step, train_config) for step in range(110)]
    assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factors[10] == pytest.approx(1.0)
    assert factors[60] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the cosine
    assert factors[109] == pytest.approx(0.1, abs=1e-3)
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_norms_and_biases_are_not_decayed(tmp_path):
    config = tiny_config(tmp_path / "run", tmp_path / "corpus.txt")
    model = build(config.model)
    decayed, plain = build_optimizer(model, config.train).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    assert decayed["weight_decay"] == config.train.weight_decay and plain["weight_decay"] == 0
    assert all("norm" in names[id(p)] or names[id(p)].endswith("bias") for p in plain["params"])
    assert any("mlp.gate.weight" in names[id(p)] for p in decayed["params"])  # the router is a matrix
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_flops_per_token_counts_active_parameters_and_attention(tmp_path):
    config = tiny_config(tmp_path / "run", tmp_path / "corpus.txt")
    model = build(config.model)
    m = config.model
    embedding = m.vocab_size * m.hidden_size
    per_layer_experts = m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
    active = model.num_params() - embedding - m.num_hidden_layers * per_layer_experts * (1 - 2 / 4)
    attention = 12 * m.num_hidden_layers * m.num_attention_heads * m.attention_head_dim * 32
    assert flops_per_token(model, seq_len=32) == pytest.approx(6 * active + attention)


def test_bfloat16_autocast_trains(tmp_path):
    # The GPU default path (autocast, fp32 master weights), exercised on the CPU.
    result = _run(tmp_path, "bf16", steps=10, dtype="bfloat16")
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert all(math.isfinite(r["loss"]) for r in records[1:])
    assert result.last_val_loss < result.first_val_loss - 1.0
    model, _ = load_model(result.checkpoint)
    assert model.lm_head.weight.dtype == torch.float32


def test_bfloat16_weights_train_and_load(tmp_path):
    # train.param_dtype = bfloat16: weights and AdamW moments in bf16 (half the memory).
    write_corpus(tmp_path)
    trainer = trainer_module.Trainer(
        tiny_config(tmp_path / "bf16w", tmp_path / "corpus.txt", steps=10, dtype="bfloat16", param_dtype="bfloat16"),
        stream=io.StringIO(),
    )
    result = trainer.run()
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {t.dtype for state in trainer.optimizer.state.values() for t in state.values() if t.dim()} == {
        torch.bfloat16
    }
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert all(math.isfinite(r["loss"]) for r in records[1:])
    assert result.last_val_loss < result.first_val_loss - 1.0
    model, _ = load_model(result.checkpoint)  # into fp32, as every checkpoint loads
    assert rel_err(model.lm_head.weight, trainer.model.lm_head.weight.float()) == 0


def test_save_every_minus_one_writes_no_checkpoint(tmp_path):
    write_corpus(tmp_path)
    result = _run(tmp_path, "nosave", steps=3, save_every=-1)
    assert result.checkpoint is None and not (result.run_dir / "checkpoints").exists()
    assert (result.run_dir / "loss.png").is_file()


def test_mfu_is_reported_where_the_peak_is_known(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module, "peak_flops", lambda device: 1e12)
    stream = io.StringIO()
    result = train(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", steps=2), stream=stream)
    config = tiny_config(tmp_path / "run", tmp_path / "corpus.txt")
    per_token = flops_per_token(build(config.model), config.train.seq_len)
    for record in read_metrics(result.run_dir / "metrics.jsonl")[1:]:
        assert record["mfu"] == pytest.approx(record["tokens_per_s"] * per_token / 1e12)
    assert "MFU" in stream.getvalue()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_asking_for_a_gpu_that_is_not_there(tmp_path):
    with pytest.raises(ConfigError, match="train.device='cuda' but torch sees no GPU"):
        train(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", device="cuda"), stream=io.StringIO())


# ---- TensorBoard and Weights & Biases (train.report_to) ------------------------------------------


def _scalars(record: dict) -> dict[str, float]:
    """The numbers of a metrics.jsonl record, as train/report.py writes them (null: none)."""
    return {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}


def test_tensorboard_holds_every_scalar_of_metrics_jsonl(tmp_path, monkeypatch):
    """A run that reports to TensorBoard, with MFU, a skipped step (its NaN gradient norm is null in
    metrics.jsonl, absent from TensorBoard) and a resume from step 10 after steps 11-15 were
    written (TensorBoard hides those, as metrics.jsonl drops them): each scalar of metrics.jsonl
    at each step is in the event file, once, and nothing else. TensorBoard keeps float32, so each
    value is compared with its float32 rounding, exactly."""
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(trainer_module, "peak_flops", lambda device: 1e12)
    _poison_step(monkeypatch, 3)
    _crash_after_saving(monkeypatch, "step_15")
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "run", save_every=5, report_to=["tensorboard"])
    monkeypatch.undo()
    run_dir = tmp_path / "run"
    shutil.rmtree(run_dir / "checkpoints" / "step_15")  # as if it had died before publishing it
    monkeypatch.setattr(trainer_module, "peak_flops", lambda device: 1e12)
    _run(tmp_path, "run", save_every=5, report_to=["tensorboard"], resume=True)

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(21))
    assert records[3]["skipped"] is True and records[3]["grad_norm"] is None
    keys = set().union(*(r.keys() for r in records)) - {"step"}
    assert {"loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "max_memory_bytes", "val_loss"} <= keys
    assert {"expert_load_max", "expert_load_min", "expert_load_max/layer_1", "expert_load_min/layer_1"} <= keys

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})  # 0: keep every event
    events.Reload()
    written = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = {}
    for record in records:
        for key, value in _scalars(record).items():
            expected.setdefault(key, []).append((record["step"], float(np.float32(value))))
    assert written.keys() == expected.keys()
    for key, points in expected.items():
        assert written[key] == points, key  # every step once, in order, the same value
    assert written["skipped"] == [(3, 1.0)]


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows (what `run.log` got) of an offline W&B run's .wandb file: LevelDB's log
    format (32 KiB blocks of records: crc32, length, type; FULL, or FIRST..MIDDLE..LAST pieces),
    after a 7-byte W&B header, each record a wandb_internal.proto Record. W&B's own reader of it
    went into its Go core; this is what `wandb sync` would upload."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = run_file.read_bytes(), 32768
    assert data[:4] == b":W&B"
    position, pieces, rows = 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the zeros that pad a block's tail
            position += left
            continue
        pieces += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record.FromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_runs_offline_unless_told_otherwise(tmp_path, monkeypatch):
    """Without WANDB_MODE, an offline W&B run in the run directory whose history holds each
    scalar of metrics.jsonl at its step, exactly (W&B keeps float64); WANDB_MODE set by the user
    wins (disabled: no run at all)."""
    wandb = pytest.importorskip("wandb", reason="W&B is an optional dependency (pip install 'moemesh[tracking]')")
    for name in ("WANDB_API_KEY", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))  # no user settings, none left behind
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setattr(trainer_module, "peak_flops", lambda device: 1e12)  # MFU too

    monkeypatch.setenv("WANDB_MODE", "disabled")
    result = _run(tmp_path, "quiet", steps=2, report_to=["wandb"])
    assert not list((result.run_dir / "wandb").glob("*run-*"))
    wandb.teardown()  # W&B reads the environment once per process

    monkeypatch.delenv("WANDB_MODE")
    result = _run(tmp_path, "run", steps=4, report_to=["wandb"])
    (run_file,) = (result.run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    records = read_metrics(result.run_dir / "metrics.jsonl")
    assert [row["_step"] for row in rows] == [r["step"] for r in records] == list(range(5))
    for row, record in zip(rows, records):
        assert {k: v for k, v in row.items() if not k.startswith("_")} == _scalars(record), record["step"]
    assert "mfu" in rows[1] and "expert_load_max/layer_0" in rows[1]


def test_expert_load_metrics_count_each_layers_choices(tmp_path):
    """expert_load_max/min of a step = the busiest / idlest expert's (token, slot) choices over the
    mean, per MoE layer, counted here from outside the routers over the step's forwards; the
    counts start afresh each step and evaluation forwards do not count."""
    trainer = trainer_module.Trainer(tiny_config(tmp_path / "run", tmp_path / "corpus.txt"), io.StringIO())
    chosen = {}
    for i, layer in enumerate(trainer.model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, args, routing, i=i: chosen[i].append(routing.expert_ids))
    for _ in range(2):
        chosen.update({i: [] for i in range(len(trainer.model.model.layers))})
        record = trainer.train_step()
        for i, ids in chosen.items():
            assert len(ids) == 2  # the step's two micro-batches
            loads = torch.bincount(torch.cat(ids).flatten(), minlength=4).double()
            assert loads.sum() == 4 * 32 * 2  # global batch × seq_len × top-k
            assert record[f"expert_load_max/layer_{i}"] == (loads.max() / loads.mean()).item()
            assert record[f"expert_load_min/layer_{i}"] == (loads.min() / loads.mean()).item()
        assert record["expert_load_max"] == max(record[f"expert_load_max/layer_{i}"] for i in chosen)
        assert record["expert_load_min"] == min(record[f"expert_load_min/layer_{i}"] for i in chosen)
        trainer.evaluate()
        assert all(torch.count_nonzero(layer.mlp.gate.expert_load) == 0 for layer in trainer.model.model.layers)


def test_config_toml_is_replaced_atomically(tmp_path, monkeypatch):
    """A run directory's config.toml is written under another name and renamed over the old one:
    a write that fails half-way leaves the old file whole, and no stray file."""
    _run(tmp_path, "run", steps=2)
    config_file = tmp_path / "run" / "config.toml"
    before = config_file.read_bytes()

    def dies_half_way(path, data):
        path.write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer_module.integrity, "write_durably", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        _run(tmp_path, "run", steps=4, resume=True)
    assert config_file.read_bytes() == before
    assert sorted(p.name for p in config_file.parent.iterdir() if "config" in p.name) == ["config.toml"]
    monkeypatch.undo()
    _run(tmp_path, "run", steps=4, resume=True)
    assert tomllib.loads(config_file.read_text())["train"]["steps"] == 4
