"""DeepSeek-V3's auxiliary-loss-free load balancing (moemesh/train/router_bias.py): the rule on a
tiny model, and the trainer in several layouts on 2 CPU processes (gloo) against one process.

After each optimizer step every correction bias moves by exactly ±rate (or not at all, at the mean
load), from the loads of the whole global batch: counted over all micro-batches and summed over
the data-parallel ranks. The loads are integers, so every layout ends with the very same biases,
compared exactly; the checkpoints (DCP and Hugging Face) keep them, in fp32."""

import io

import pytest
import torch

from moemesh.checkpoint.hf import save_pretrained
from moemesh.checkpoint.load import from_pretrained, load_model
from moemesh.config import config_from_dict
from moemesh.models import build
from moemesh.train.router_bias import update_router_bias
from moemesh.train.trainer import Trainer
from test_parallel_families import DEEPSEEK_V3
from tiny_run import tiny_raw, write_corpus

WORLD = 2
RATE = 0.01
STEPS = 3
BIAS = "e_score_correction_bias"

MODEL = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 12,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "intermediate_size": 32,
    "moe_intermediate_size": 16,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "max_position_embeddings": 128,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}
# 2 micro-batches of 4 sequences per step: each of 2 data-parallel ranks routes 2 sequences of each
TRAIN = {
    "steps": STEPS,
    "global_batch": 8,
    "micro_batch": 4,
    "eval_every": 0,
    "save_every": 0,
    "router_bias_update_rate": RATE,
}


def biases(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.named_buffers() if name.endswith(BIAS)}


def routers(model):
    return [m for m in model.modules() if hasattr(m, BIAS)]


def test_the_rule_moves_each_bias_by_rate_toward_balance():
    model = build(DEEPSEEK_V3, seed=1)
    chosen = []  # every layer's expert choices, seen from outside the router
    for router in routers(model):
        router.register_forward_hook(lambda module, args, routing: chosen.append(routing.expert_ids))
    input_ids = torch.randint(0, DEEPSEEK_V3.vocab_size, (4, 9))
    for micro_batch in input_ids.split(2):  # two training forwards count, evaluation ones do not
        model(micro_batch)
    with torch.no_grad():
        model(input_ids)
    model.eval()
    model(input_ids)
    model.train()

    layers = len(routers(model))
    expected_loads = [
        torch.bincount(torch.cat(chosen[i : 2 * layers : layers]).flatten(), minlength=8) for i in range(layers)
    ]
    for router, load in zip(routers(model), expected_loads):
        assert torch.equal(router.expert_load, load)
    update_router_bias(model, RATE, group=None)
    for router, load in zip(routers(model), expected_loads):
        step = torch.sign(load.sum() / 8 - load) * torch.tensor(RATE)
        assert torch.equal(router.e_score_correction_bias, step)  # from zero: exactly ±rate
        assert torch.count_nonzero(router.expert_load) == 0  # the next step counts afresh, in the same tensor

    # experts at the mean load keep their bias; the over-loaded one goes down, the under-loaded up
    router = routers(model)[0]
    router.e_score_correction_bias.zero_()
    router.expert_load = torch.tensor([5, 3, 3, 1, 3, 3, 3, 3])  # mean 3
    update_router_bias(model, RATE, group=None)
    assert torch.equal(router.e_score_correction_bias, torch.tensor([-1.0, 0, 0, 1, 0, 0, 0, 0]) * RATE)


def test_rate_zero_leaves_the_bias_alone():
    model = build(DEEPSEEK_V3, seed=1)
    model(torch.randint(0, DEEPSEEK_V3.vocab_size, (2, 9)))
    update_router_bias(model, 0.0, group=None)
    assert all(torch.equal(t, torch.zeros(8)) for t in biases(model).values())
    assert all(torch.count_nonzero(router.expert_load) == 0 for router in routers(model))


def test_the_bias_stays_fp32_in_a_bf16_model(tmp_path):
    model = build(DEEPSEEK_V3, seed=1, dtype=torch.bfloat16)
    assert {t.dtype for t in biases(model).values()} == {torch.float32}
    with torch.no_grad():
        for t in biases(model).values():
            t.fill_(0.5 + 0.001)  # between two bf16 numbers
    save_pretrained(model, tmp_path)
    loaded = from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for name, t in biases(loaded).items():
        assert torch.equal(t, biases(model)[name]), name


def train_steps(rank, raw: dict, save: bool) -> dict[str, list[float]]:
    trainer = Trainer(config_from_dict(raw), io.StringIO())
    for _ in range(STEPS):
        trainer.train_step()
    if save:
        trainer.save()
    return {name: t.tolist() for name, t in biases(trainer.model).items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the biases after STEPS steps, and an untrained comparison."""
    directory = tmp_path_factory.mktemp("router_bias")
    raw = tiny_raw(directory / "single", write_corpus(directory), **TRAIN)
    raw["model"] = dict(MODEL)
    return raw, train_steps(0, raw, save=False)


def test_training_moves_the_bias_and_rate_zero_does_not(reference):
    raw, trained = reference
    assert len(trained) == 2
    for values in trained.values():
        steps = torch.tensor(values) / RATE
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() >= 1
    off = {**raw, "train": {**raw["train"], "router_bias_update_rate": 0.0}}
    assert all(v == [0.0] * 8 for v in train_steps(0, off, save=False).values())


LAYOUTS = {
    "dp2": dict(dp_replicate=2),
    "dp_shard2": dict(dp_shard=2),
    "ep2": dict(ep=2),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2, pp_schedule="1f1b"),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_layout_ends_with_the_biases_of_one_process(pool, reference, tmp_path, layout):
    raw, expected = reference
    raw = {**raw, "parallel": layout, "train": {**raw["train"], "run_dir": str(tmp_path)}}
    save = "dp_shard" in layout  # a sharded checkpoint keeps the bias
    per_rank = pool.run(train_steps, raw, save)
    if "pp" in layout:  # each pipeline rank holds its own layers
        per_rank = [{k: v for r in per_rank for k, v in r.items()}]
    for ours in per_rank:
        assert ours == expected
    if save:
        model, _ = load_model(tmp_path)
        assert {k: v.tolist() for k, v in biases(model).items()} == expected
