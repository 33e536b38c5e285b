"""A training step's forward and backward as one CUDA graph (`train.cuda_graphs`,
train/cuda_graph.py).

On a GPU: replays of the captured step give the eager step's loss, gradients and router counts,
for new inputs copied into its buffers and accumulated over replays; and the trainer's graphed run
(LoRA on attention and every expert, and full fine-tuning) follows the eager run step by step.
Without a GPU: the run that asks for graphs is refused with one line. (The layouts and the LoRA
dropout that graphs refuse are in test_config.py.)

Tolerance: both sides launch the same kernels on the same bf16 inputs, so they agree but for the
order of atomic additions inside a few kernels, each a bf16 rounding (2^-9 relative) at most:
gradients within 1e-2 relative, losses within 1e-3 (a wrong input buffer, a lost or doubled
micro-batch or a stale router count is orders larger: tested against other inputs below).
"""

from __future__ import annotations

import io

import pytest
import torch

from moemesh.config import config_from_dict
from moemesh.errors import ConfigError
from moemesh.models import ModelConfig
from moemesh.models.build import init_weights, meta_model
from moemesh.models.lora import LoraConfig, apply_lora
from moemesh.train.cuda_graph import CapturedStep
from moemesh.train.metrics import read_metrics
from moemesh.train.trainer import train
from numerics import rel_err
from tiny_run import TINY_MODEL, tiny_config, tiny_raw, write_corpus

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def _lora_model() -> torch.nn.Module:
    config = ModelConfig.from_hf_dict({**TINY_MODEL, "num_hidden_layers": 3})
    model = meta_model(config, torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    apply_lora(model, LoraConfig(rank=8, alpha=16.0, targets=targets, experts=True), torch.float32)
    model.activation_checkpointing = "full"
    model.to_empty(device="cuda")
    model.tie_weights()
    init_weights(model, 0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.3)
    return model.train()


def _counts(model) -> list[torch.Tensor]:
    return [m.expert_load.clone() for m in model.modules() if getattr(m, "expert_load", None) is not None]


def _clear_counts(model) -> None:
    for m in model.modules():
        if getattr(m, "expert_load", None) is not None:
            m.expert_load.zero_()


@gpu
def test_replays_give_the_eager_steps_gradients_and_counts():
    torch.manual_seed(0)
    model = _lora_model()
    trained = [p for p in model.parameters() if p.requires_grad]

    def forward_backward(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        loss.backward()
        return (loss.detach(),)

    inputs = [torch.randint(0, 256, (2, 64), device="cuda") for _ in range(2)]
    eager = []
    for ids in inputs:
        (loss,) = forward_backward(ids)
        eager.append((loss.clone(), [p.grad.clone() for p in trained], _counts(model)))
        for p in trained:
            p.grad = None
        _clear_counts(model)

    captured = CapturedStep(forward_backward, [torch.zeros_like(inputs[0])], trained)
    _clear_counts(model)  # the warm-up's
    assert all(torch.count_nonzero(p.grad) == 0 for p in trained)
    for ids, (loss, grads, counts) in zip(inputs, eager):
        (replayed,) = captured(ids)
        assert rel_err(replayed, loss) <= 1e-3
        for got, expected in zip([p.grad for p in trained], grads, strict=True):
            assert rel_err(got, expected) <= 1e-2
        assert all(torch.equal(a, b) for a, b in zip(_counts(model), counts, strict=True))
        captured.zero_grad()
        _clear_counts(model)
    assert rel_err(eager[0][1][0], eager[1][1][0]) > 0.1  # the two inputs' gradients differ: the buffer matters

    for ids in inputs:  # without zeroing, replays add up as eager backwards do
        captured(ids)
    for got, first, second in zip([p.grad for p in trained], eager[0][1], eager[1][1], strict=True):
        assert rel_err(got, first + second) <= 1e-2


@gpu
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_graphed_run_follows_the_eager_run(tmp_path, lora):
    corpus = write_corpus(tmp_path)
    curves = []
    for graphs in (False, True):
        raw = tiny_raw(tmp_path / f"run{graphs}", corpus, steps=4, eval_every=0, save_every=-1, device="cuda")
        raw["train"].update(dtype="bfloat16", cuda_graphs=graphs, activation_checkpointing="full")
        if lora:
            raw["lora"] = {"rank": 8, "alpha": 16.0, "experts": True}
        run = train(config_from_dict(raw), stream=io.StringIO())
        curves.append([r for r in read_metrics(run.run_dir / "metrics.jsonl") if "loss" in r])
    assert len(curves[0]) == len(curves[1]) == 4
    for eager, graphed in zip(*curves):
        for key in ("loss", "aux_loss", "grad_norm"):
            assert graphed[key] == pytest.approx(eager[key], rel=1e-3), (eager["step"], key)
        assert graphed["expert_load_max"] == eager["expert_load_max"]
    assert curves[1][-1]["loss"] < curves[1][0]["loss"]  # it learns


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_graphs_without_a_gpu_are_refused(tmp_path):
    write_corpus(tmp_path)
    with pytest.raises(ConfigError, match="train.cuda_graphs needs a GPU and train.dtype bfloat16"):
        train(tiny_config(tmp_path / "run", tmp_path / "corpus.txt", cuda_graphs=True), stream=io.StringIO())
