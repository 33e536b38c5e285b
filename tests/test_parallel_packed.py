"""Packed chat rows in every layout on CPU/gloo: under EP, TP, FSDP and DualPipeV (2 ranks each) a
run on a messages file gives one process's per-step loss, load-balancing loss and gradient norm
(1e-5 relative) and its weights after the steps (loaded whole from the sharded checkpoint). With
tests/test_data_chat.py's proof that one process's packed step is its rows one by one, packed =
row by row in each layout."""

from __future__ import annotations

import io
import json

import pytest
import torch

pytest.importorskip("tokenizers", reason="a tokenizer.json needs the tokenizers package")

from moemesh.checkpoint.load import load_model  # noqa: E402
from moemesh.config import config_from_dict  # noqa: E402
from moemesh.train.trainer import Trainer  # noqa: E402
from serving import write_checkpoint  # noqa: E402
from test_data_chat import CONVERSATIONS, TINY  # noqa: E402
from tiny_run import TINY_TRAIN  # noqa: E402

WORLD = 2
STEPS = 3
RTOL = 1e-5
LAYOUTS = {"ep2": {"ep": 2}, "tp2": {"tp": 2}, "dp_shard2": {"dp_shard": 2}, "pp2": {"pp": 2}}


def train_steps(rank, raw: dict) -> list[dict]:
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    try:
        records = [trainer.train_step() for _ in range(STEPS)]
        records[-1]["val_loss"] = trainer.evaluate()
        trainer.save()
        return records
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = tmp_path_factory.mktemp("packed")
    tokenizer = write_checkpoint(directory / "tokenizer") / "tokenizer.json"
    data = directory / "chat.jsonl"
    rows = [{"messages": m} for m in CONVERSATIONS * 12]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = {**TINY_TRAIN, "seq_len": 96, "global_batch": 8, "micro_batch": 2, "run_dir": str(directory / "single")}
    raw = {
        "model": {**TINY.to_hf_dict(), "output_router_logits": True, "router_aux_loss_coef": 0.01},
        "train": train,
        "data": {"path": str(data), "tokenizer": str(tokenizer), "val_fraction": 0.1},
    }
    return raw, train_steps(0, raw)


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_packed_rows_in_each_layout_equal_one_process(pool, reference, tmp_path, layout):
    raw, records = reference
    ours = pool.run(train_steps, {**raw, "parallel": layout, "train": {**raw["train"], "run_dir": str(tmp_path)}})
    for rank_records in ours:
        for step, (a, b) in enumerate(zip(rank_records, records, strict=True)):
            for key in ("loss", "aux_loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= RTOL * abs(b[key]), (step, key, a[key], b[key])
        assert abs(rank_records[-1]["val_loss"] - records[-1]["val_loss"]) <= RTOL * records[-1]["val_loss"]
    sharded, _ = load_model(tmp_path)
    whole, _ = load_model(raw["train"]["run_dir"])
    for (name, p), q in zip(sharded.state_dict().items(), whole.state_dict().values()):
        assert p.shape == q.shape and ((p - q).norm() / q.norm()).item() <= RTOL, name
    torch.testing.assert_close(sharded.lm_head.weight, whole.lm_head.weight, rtol=RTOL, atol=1e-6)
