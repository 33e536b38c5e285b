"""Per-layer saved-tensor profile, the analytical estimate it checks, and `moemesh estimate`."""

from __future__ import annotations

import pytest
import torch

from moemesh.cli import main
from moemesh.config import load_config, resolve_device
from moemesh.models import build
from moemesh.parallel.pipeline.memory import estimate_layer_costs, profile_costs, profile_layers, run_costs
from moemesh.parallel.pipeline.partition import LayerCost, rank_memory


def _tiny_model_config(**changes):
    """configs/tiny.toml's model, cut to 2 layers."""
    return load_config(None, ["model.num_hidden_layers=2"]).model.replace(**changes)


# (weights' dtype, autocast to bf16): fp32 throughout; fp32 weights under bf16 autocast, as `moemesh
# train` runs on a GPU (an fp32 residual stream, bf16 matmuls); bf16 weights (train.param_dtype).
PRECISIONS = {
    "fp32": (None, False),
    "fp32-weights-bf16-autocast": (None, True),
    "bf16-weights": (torch.bfloat16, False),
}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize(
    "changes",
    [{}, {"mlp_only_layers": [0], "intermediate_size": 96, "qk_norm": False, "norm_topk_prob": False}],
    ids=["moe", "dense-first"],
)
def test_analytical_activations_match_profile(triton_kernels, changes, precision):
    """On the kernel path (here Triton's interpreter on CPU) the formula counts the very tensors
    autograd saves, so it agrees to the byte, in each precision a run uses: any change to what a
    layer saves must come with its term in the formula."""
    weights, autocast = PRECISIONS[precision]
    config = _tiny_model_config(**changes)
    model = build(config, seed=0, device="cpu", dtype=weights)
    batch, seq = torch.randint(1, 3, ()).item(), 8
    ids = torch.randint(config.vocab_size, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        profiles = profile_layers(model, ids, ids)
    dtype_bytes = 2 if autocast or weights is not None else 4
    estimates = estimate_layer_costs(
        config,
        batch * seq,
        dtype_bytes=dtype_bytes,
        state_bytes_per_param=1,
        seq_len=seq,
        residual_bytes=2 if weights is not None else 4,
    )

    assert [p.name for p in profiles] == ["embedding", "layer 0", "layer 1", "head"]
    assert [e.name for e in estimates] == [p.name for p in profiles]
    for measured, estimated in zip(profiles, estimates):
        assert estimated.activation_bytes == measured.activation_bytes, measured.name
        assert estimated.param_bytes == measured.params, measured.name
    assert sum(p.params for p in profiles) == model.num_params()
    # Every matmul of a layer saves its weight; the embedding lookup saves none.
    assert profiles[0].weight_bytes == 0 and all(p.weight_bytes > 0 for p in profiles[1:3])


def test_profile_on_reference_ops_and_costs():
    """The default CPU path (PyTorch reference ops) runs too, and its costs feed rank memory."""
    config = _tiny_model_config(tie_word_embeddings=True)
    model = build(config, seed=0, device="cpu")
    ids = torch.randint(config.vocab_size, (2, 16))
    profiles = profile_layers(model, ids, ids)
    assert all(p.seconds > 0 and p.activation_bytes > 0 for p in profiles)
    assert sum(p.params for p in profiles) == model.num_params()  # the tied weight once
    assert profiles[-1].params == config.hidden_size  # the head keeps only its norm

    costs = profile_costs(profiles, state_bytes_per_param=16, rank_params=[p.params / 2 for p in profiles])
    assert [c.param_bytes for c in costs] == [p.params * 8 for p in profiles]
    in_flight, stage_rank = [3, 1], [0, 0]  # one rank holding both stages, as DualPipeV pairs them
    memory = rank_memory(costs, [range(2), range(2, 4)], in_flight, stage_rank)
    expected = sum(c.param_bytes for c in costs) + sum(
        c.activation_bytes * (3 if i < 2 else 1) for i, c in enumerate(costs)
    )
    hidden_states = 2 * 16 * config.hidden_size * 4  # the first stage's output, fp32, per micro-batch in flight
    assert profiles[1].output_bytes == hidden_states and profiles[-1].output_bytes == 4  # the loss
    assert memory == [pytest.approx(expected + 3 * hidden_states)]


def test_estimate_scales_with_tokens_and_shard():
    config = _tiny_model_config()
    small = estimate_layer_costs(config, 64)
    large = estimate_layer_costs(config, 128, shard=4)
    assert all(isinstance(c, LayerCost) for c in small)
    for a, b in zip(small[:-1], large[:-1]):  # the head's weight gradient does not grow with tokens
        assert b.activation_bytes == pytest.approx(2 * a.activation_bytes, rel=0.05)
        assert b.param_bytes == a.param_bytes / 4
    assert large[1].time > small[1].time > 0


def _stage_rows(output: str) -> list[tuple[int, str, str]]:
    """(rank, first layer, last layer) of each row of the stage table."""
    lines = output.split("stages (")[1].split("\n\n")[0].splitlines()[2:]
    rows = []
    for line in lines:
        _, rank, rest = line.split(maxsplit=2)
        layers = rest.rsplit(maxsplit=4)[0]  # then in flight, memory (number, unit), time
        first, _, last = layers.partition(" .. ")
        rows.append((int(rank), first, last or first))
    return rows


@pytest.mark.parametrize(
    "argv",
    [["--pp", "2", "--schedule", "1f1b"], ["--pp", "2", "--schedule", "dualpipev", "--set", "train.micro_batch=4"]],
)
def test_estimate_command(capsys, argv):
    assert main(["estimate", "--config", "configs/tiny.toml", *argv]) == 0
    output = capsys.readouterr().out
    names = ["embedding"] + [f"layer {i}" for i in range(4)] + ["head"]
    table = output.split("\n\n")[0]
    assert all(f"\n  {name} " in table for name in names)
    rows = _stage_rows(output)
    assert len(rows) == (2 if "1f1b" in argv else 4)
    covered = []
    for _, first, last in rows:  # consecutive stages, each a run of consecutive layers
        assert names.index(first) == len(covered)
        covered += names[names.index(first) : names.index(last) + 1]
    assert covered == names
    assert output.count("  pipeline rank ") == 2


def test_estimate_command_errors(capsys):
    assert (
        main(
            [
                "estimate",
                "--config",
                "configs/tiny.toml",
                "--pp",
                "8",
                "--schedule",
                "1f1b",
                "--set",
                "train.micro_batch=2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot split 6 layers" in err and "into 8 non-empty pipeline stages" in err


def test_head_working_memory_counts_once_per_stage():
    """The fused cross-entropy's fp32 [V, H] accumulator and logits chunk exist only while the
    head's forward runs: the stage holding the head pays them once, whatever its micro-batches in flight."""
    config = _tiny_model_config()
    costs = estimate_layer_costs(config, 64)
    V, H = config.vocab_size, config.hidden_size
    assert costs[-1].working_bytes == 4 * V * H + 64 * V * 2 and all(c.working_bytes == 0 for c in costs[:-1])
    ranges, stage_rank = [range(2), range(2, 4)], [0, 1]
    one, three = (rank_memory(costs, ranges, [n, n], stage_rank) for n in (1, 3))
    per_micro = sum(c.activation_bytes for c in costs[2:])
    assert three[1] - one[1] == pytest.approx(2 * per_micro)  # the working memory is not multiplied
    assert one[1] == pytest.approx(sum(c.param_bytes for c in costs[2:]) + per_micro + costs[-1].working_bytes)


@pytest.mark.parametrize(
    "layout",
    [{"ep": 4}, {"tp": 2}, {"dp_shard": 2}, {"dp_shard": 2, "ep": 2, "tp": 2}],
    ids=["ep4", "tp2", "dp_shard2", "dp_shard2-ep2-tp2"],
)
def test_a_rank_keeps_its_share_of_each_item(layout):
    """The parameter state `moemesh estimate` charges a rank: of each item, the experts over ep ×
    tp × dp_shard, the other matrices over tp (the router stays whole) and, under FSDP, over
    dp_shard × ep; the norms are whole under TP, split by FSDP when it divides them."""
    from moemesh.models.build import meta_model
    from moemesh.parallel.pipeline.memory import rank_param_counts

    config = load_config(None, [f"parallel.{axis}={size}" for axis, size in layout.items()], launched=False)
    ep, tp, dp_shard = (layout.get(axis, 1) for axis in ("ep", "tp", "dp_shard"))
    fsdp = dp_shard * ep if dp_shard > 1 else 1  # what FSDP splits the dense weights over
    model = meta_model(config.model)
    expected = [0.0] * (2 + config.model.num_hidden_layers)
    for name, param in model.named_parameters():
        item = (
            0
            if "embed_tokens" in name
            else -1
            if name.startswith(("lm_head", "model.norm"))
            else 1 + int(name.split(".")[2])
        )
        if ".mlp.experts." in name:
            share = ep * tp * dp_shard
        elif param.dim() >= 2:  # attention, router (replicated under TP), embedding and head
            share = (1 if ".mlp.gate." in name else tp) * fsdp
        else:  # norms, q/k norms: whole under TP; FSDP splits those it divides
            share = fsdp if param.shape[0] % fsdp == 0 else 1
        expected[item] += param.numel() / share
    assert rank_param_counts(config.model, config.parallel) == pytest.approx(expected)


def _costs(config):
    return run_costs(config.model, config.parallel, resolve_device(config).step_shape)


def test_activation_checkpointing_shrinks_the_estimate():
    """Full: a decoder layer keeps its input per micro-batch, and needs what it saved before once,
    while it recomputes; one more forward (a third of forward + backward). Selective keeps the
    matmul outputs too: between the two."""
    overrides = ["model.num_hidden_layers=2", "train.micro_batch=2", "train.seq_len=64"]
    costs = {
        mode: _costs(load_config(None, [*overrides, f"train.activation_checkpointing={mode}"], launched=False))
        for mode in ("none", "full", "selective")
    }
    config = load_config(None, overrides, launched=False)
    tokens = config.train.micro_batch * config.train.seq_len
    for plain, full, selective in zip(*costs.values()):
        if not plain.name.startswith("layer "):
            assert plain == full == selective
            continue
        assert full.activation_bytes == tokens * config.model.hidden_size * 4
        assert full.activation_bytes < selective.activation_bytes < plain.activation_bytes
        assert full.working_bytes == selective.working_bytes == plain.activation_bytes
        assert full.time == plain.time * 4 / 3 and selective.time == plain.time


def test_lora_keeps_the_frozen_base_alone():
    """Under LoRA a parameter costs its frozen weight in the compute dtype (no gradient, no AdamW
    state): 4 bytes on CPU, against 16 for full training."""
    overrides = ["model.num_hidden_layers=2"]
    full = _costs(load_config(None, overrides, launched=False))
    lora = _costs(load_config(None, [*overrides, "lora.rank=8"], launched=False))
    for a, b in zip(full, lora):
        assert b.param_bytes == a.param_bytes / 4 and b.activation_bytes == a.activation_bytes


def test_estimate_counts_the_pairs_of_an_overlapped_ep_step(capsys):
    """Under EP without a pipeline, parallel.pp_overlap pairs each forward with the previous
    micro-batch's backward: two micro-batches' activations in flight, which the estimate charges."""
    base = ["estimate", "--config", "configs/tiny.toml", "--set", "parallel.ep=2", "train.micro_batch=2"]
    assert main(base) == 0
    alone = capsys.readouterr().out
    assert main([*base, "parallel.pp_overlap=true"]) == 0
    paired = capsys.readouterr().out
    assert "stages (1f1b, pp=1" in alone and "stages (paired, pp=1" in paired
    memory = [float(out.split("pipeline rank 0:")[1].split()[0]) for out in (alone, paired)]
    assert memory[1] > memory[0]
