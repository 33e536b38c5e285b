"""LoRA runs: their checkpoints (the adapters and their AdamW state, not the frozen base; resumed
exactly) and PEFT's format both ways, on transformers 5 + peft, fp32 on CPU:

- an adapter moemesh trains (`train.init_from` a Hugging Face base, then `moemesh convert`) loads
  into transformers with `PeftModel.from_pretrained` and gives moemesh's logits (with the adapter
  merged at load, as `generate --adapter` does), attention-only and on every expert;
- an adapter PEFT makes (`get_peft_model`, its factors randomised) loads into moemesh for
  generation, including PEFT's own rewrite of gate_proj/up_proj/down_proj targets into the fused
  expert banks with a doubled rank (rank_pattern, alpha_pattern);
- `moemesh convert --merge` writes the merged model, which transformers loads with the same logits.

Tolerance 1e-5 relative: the same fp32 function in different operation orders (merged weights
against PEFT's separate low-rank products, moemesh's grouped expert loop against transformers')."""

import io
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from moemesh.checkpoint.hf import save_pretrained
from moemesh.checkpoint.load import init_source
from moemesh.cli import main
from moemesh.config import config_from_dict
from moemesh.inference.generate import load_for_generation
from moemesh.models import ModelConfig, build
from moemesh.train.progress import format_count
from moemesh.train.trainer import Trainer, train
from numerics import rel_err
from tiny_run import tiny_raw, write_corpus

peft = pytest.importorskip("peft", reason="PEFT round trips need the peft package (pip install moemesh[test])")
transformers = pytest.importorskip("transformers")

RTOL = 1e-5
BASE = ModelConfig.from_hf_dict(
    dict(
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,  # in-features of down_proj (24) differ from gate_up_proj's (32)
        max_position_embeddings=128,
        initializer_range=0.2,
        norm_topk_prob=True,
    )
)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lora") / "base"
    save_pretrained(build(BASE, seed=7), directory)
    return directory


def lora_raw(directory, base, lora: dict, **train) -> dict:
    raw = tiny_raw(directory / "run", write_corpus(directory), init_from=str(base), **train)
    del raw["model"]  # the base's config.json says what the model is
    raw["lora"] = lora
    return raw


def hf_logits(model, input_ids):
    with torch.no_grad():
        return model(input_ids).logits


def ours_logits(base, adapter, input_ids):
    model, _ = load_for_generation(base, device="cpu", dtype=torch.float32, adapter=adapter)
    with torch.no_grad():
        return model(input_ids).logits


@pytest.mark.parametrize("experts", [False, True], ids=["attention", "attention-and-experts"])
def test_moemesh_adapter_loads_into_peft(tmp_path, base, experts):
    raw = lora_raw(
        tmp_path, base, {"rank": 4, "alpha": 8.0, "targets": ATTENTION, "experts": experts}, steps=4, lr=2e-2
    )
    train(config_from_dict(raw, init_source=init_source))
    adapter = tmp_path / "peft"
    assert main(["convert", str(tmp_path / "run"), str(adapter)]) == 0
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(saved["target_parameters"]) == (
        sorted(f"model.layers.{i}.mlp.experts.{bank}" for i in range(2) for bank in ("gate_up_proj", "down_proj"))
        if experts
        else []
    )

    input_ids = torch.randint(0, BASE.vocab_size, (2, 13))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    plain = hf_logits(hf, input_ids)
    adapted = hf_logits(peft.PeftModel.from_pretrained(hf, adapter), input_ids)
    ours = ours_logits(base, tmp_path / "run", input_ids)
    assert rel_err(adapted, plain) > 1e-3  # the trained adapter changes the logits
    assert rel_err(ours, adapted) <= RTOL
    assert rel_err(ours_logits(base, adapter, input_ids), adapted) <= RTOL  # the PEFT directory reads back

    merged = tmp_path / "merged"
    assert main(["convert", str(tmp_path / "run"), str(merged), "--merge"]) == 0
    assert (
        rel_err(
            hf_logits(transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32), input_ids),
            adapted,
        )
        <= RTOL
    )


@pytest.mark.parametrize(
    "targets",
    [
        {"target_modules": ATTENTION},
        {"target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
        {"target_modules": ["q_proj", "o_proj"], "target_parameters": ["mlp.experts.down_proj"]},
        # PEFT rewrites these (transformers 4's per-expert names) into the fused banks, gate_up_proj at rank 2r
        {"target_modules": ["q_proj", "gate_proj", "up_proj", "down_proj"]},
    ],
    ids=["attention", "experts", "down-only", "per-expert-names"],
)
def test_peft_adapter_loads_into_moemesh(tmp_path, base, targets):
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=12, **targets))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2, generator=generator)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    input_ids = torch.randint(0, BASE.vocab_size, (2, 13))
    theirs = hf_logits(model, input_ids)
    assert rel_err(ours_logits(base, adapter, input_ids), theirs) <= RTOL


def test_lora_checkpoints_hold_the_adapters_and_resume_exactly(tmp_path, base):
    """A LoRA run's checkpoint holds the adapters and their AdamW moments (under the model's
    and optimizer's keys), never a base weight; resumed after its step-3 checkpoint, steps 4 and 5
    are those of the uninterrupted run, bit for bit."""
    import torch.distributed.checkpoint as dcp

    from moemesh.models.lora import is_adapter

    lora = {"rank": 4, "alpha": 8.0}
    raw = lora_raw(tmp_path, base, lora, steps=5, save_every=3, eval_every=0, activation_checkpointing="selective")
    train(config_from_dict(raw, init_source=init_source))
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checkpoint = run / "checkpoints" / "step_3"
    keys = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    model_keys = {
        key.removeprefix("model.").removesuffix(".gate").removesuffix(".up") for key in keys if key.startswith("model.")
    }
    assert model_keys and all(is_adapter(key) for key in model_keys)
    moments = {  # optimizer.state.<parameter>.exp_avg (.gate and .up for a packed one)
        key.removeprefix("optimizer.state.").partition(".exp_avg")[0]
        for key in keys
        if key.startswith("optimizer.state.") and ".exp_avg." in key + "."
    }
    assert moments == model_keys
    assert (checkpoint / "lora.json").is_file()

    shutil.rmtree(run / "checkpoints" / "step_5")
    trainer = Trainer(config_from_dict({**raw, "train": {**raw["train"], "resume": True}}, init_source=init_source))
    trainer.restore(checkpoint)
    resumed = [trainer.train_step() for _ in range(2)]
    ours = [r for r in records if "loss" in r][3:]
    for a, b in zip(resumed, ours, strict=True):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])


def test_a_lora_checkpoint_is_not_taken_for_a_whole_model(tmp_path, base):
    raw = lora_raw(tmp_path, base, {"rank": 2}, steps=1, save_every=1, eval_every=0)
    train(config_from_dict(raw, init_source=init_source))
    plain = {**raw, "lora": {"rank": 0}, "train": {**raw["train"], "resume": True}}
    from moemesh.errors import CheckpointError

    with pytest.raises(CheckpointError, match="holds LoRA adapters"):
        Trainer(config_from_dict(plain, init_source=init_source)).restore(tmp_path / "run" / "checkpoints" / "step_1")
    from moemesh.errors import ConfigError

    on_adapters = {**raw, "train": {**raw["train"], "init_from": str(tmp_path / "run"), "run_dir": str(tmp_path / "x")}}
    with pytest.raises(ConfigError, match="is a LoRA run, which holds adapters and no base weights"):
        Trainer(config_from_dict(on_adapters, init_source=init_source))


@pytest.mark.parametrize(
    "other, what",
    [
        (
            {"num_experts": 8},
            r"its model\.layers\.0\.mlp\.experts\.gate_up_proj adapters are of 4 experts at rank 4 "
            r"\(adapter_config\.json's\); this model has 8 experts a layer",
        ),
        ({"num_hidden_layers": 1}, r"this model has no model\.layers\.1\."),
        ({"hidden_size": 48}, r"its model\.layers\.0\.\S+ has shape \(.*32.*\), this model's \(.*48.*\)"),
    ],
    ids=["more-experts", "fewer-layers", "wider"],
)
def test_an_adapter_on_another_base_model_says_so(tmp_path, base, capsys, other, what):
    """An adapter (moemesh's own, in PEFT's format) given to `generate` with a base other than its
    own stops in one line that names the cause — another base model, the one its
    adapter_config.json names — and what does not fit; not a rank its adapter_config.json
    contradicts (the expert banks' rank read off a tensor that holds another number of experts)."""
    raw = lora_raw(tmp_path, base, {"rank": 4, "alpha": 8.0}, steps=1, eval_every=0, save_every=0)
    train(config_from_dict(raw, init_source=init_source))
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "adapter")]) == 0
    save_pretrained(build(BASE.replace(**other), seed=7), tmp_path / "other")
    capsys.readouterr()
    args = ["--checkpoint", str(tmp_path / "other"), "--adapter", str(tmp_path / "adapter"), "--prompt", "x"]
    assert main(["generate", *args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    cause = f"moemesh generate: error: {tmp_path / 'adapter'} was made for another base model ({base.resolve()}): "
    assert err.startswith(cause) and err.count("\n") == 1, err
    assert re.search(what, err), err


@pytest.mark.parametrize(
    "lora, adapters, line",
    [
        (
            {"rank": 4},
            # per layer: attention 896 (q, o: 4·32 + 32·4; k, v: 4·32 + 16·4), banks 2,176 (4 experts × (4·32 + 48·4
            # + 4·24 + 32·4))
            "6.1k",
            "rank 4 adapters on 8 projections (q_proj, k_proj, v_proj, o_proj) and 4 expert banks (gate_up_proj, "
            "down_proj of every expert in 2 MoE layers); 6.1k parameters train on this rank, the base is frozen",
        ),
        (
            {"rank": 4, "targets": ["q_proj", "mlp.gate"], "experts": False},
            "512",
            "rank 4 adapters on 2 projections (q_proj); 2 routers in full (a target names them); 768 parameters "
            "train on this rank, the rest of the base is frozen",
        ),
    ],
    ids=["attention-and-experts", "a-router-named"],
)
def test_the_start_up_lines_say_what_trains(tmp_path, base, lora, adapters, line):
    """The lora line says what trains: projections by kind, expert banks apart from them, routers
    only when a target names them. The model line gives the base's parameters and the adapters'
    apart."""
    raw = lora_raw(tmp_path, base, lora, steps=1, eval_every=0, save_every=-1)
    out = io.StringIO()
    train(config_from_dict(raw, init_source=init_source), stream=out)
    lines = out.getvalue().splitlines()
    model = build(BASE)
    assert lines[0].endswith(
        f"; {format_count(model.num_params())} parameters, {format_count(model.num_params(active=True))} active per "
        f"token; {adapters} more in LoRA adapters"
    )
    assert f"lora    {line}" in lines


def test_generate_with_an_adapter_equals_the_merged_model(tmp_path, base, capsys):
    """`generate --adapter RUN` (merged at load) prints what the `convert --merge` model prints."""
    raw = lora_raw(tmp_path, base, {"rank": 4, "alpha": 16.0}, steps=3, lr=5e-2)
    train(config_from_dict(raw, init_source=init_source))
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "merged"), "--merge"]) == 0
    capsys.readouterr()
    outputs = []
    for args in (
        ["--checkpoint", str(base), "--adapter", str(tmp_path / "run")],
        ["--checkpoint", str(tmp_path / "merged")],
    ):
        assert main(["generate", *args, "--prompt", "def f(", "--max-new-tokens", "8", "--device", "cpu"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0]) > len("def f(")


def test_what_peft_cannot_read_is_refused(tmp_path, base, capsys):
    """A dense-MLP adapter of a Qwen3-MoE model (PEFT would read its names as experts) is not
    written in PEFT's format; --merge wants an adapter."""
    dense = BASE.replace(mlp_only_layers=[0], intermediate_size=40)
    save_pretrained(build(dense, seed=7), tmp_path / "dense")
    raw = lora_raw(tmp_path, tmp_path / "dense", {"rank": 2, "targets": ["q_proj", "gate_proj"]}, steps=1, eval_every=0)
    train(config_from_dict(raw, init_source=init_source))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "peft")]) == 2
    assert "cannot be written in PEFT's format" in capsys.readouterr().err
    assert not (tmp_path / "peft").exists()
    assert main(["convert", str(base), str(tmp_path / "x"), "--merge"]) == 2
    assert "--merge and --base take a LoRA run or a PEFT adapter" in capsys.readouterr().err


def test_training_continues_from_a_peft_adapter(tmp_path, base):
    """lora.init_from a PEFT adapter: the run starts from its factors (its validation loss is the
    merged model's, `convert --merge` of the PEFT directory) and trains them."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    targets = {"target_modules": ["q_proj", "v_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]}
    model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, **targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "adapter")
    assert main(["convert", str(tmp_path / "adapter"), str(tmp_path / "merged"), "--merge", "--base", str(base)]) == 0

    raw = lora_raw(tmp_path, base, {"init_from": str(tmp_path / "adapter")}, steps=2, eval_every=0, save_every=0)
    trainer = Trainer(config_from_dict(raw, init_source=init_source))
    merged = Trainer(
        config_from_dict(
            {
                **lora_raw(tmp_path, tmp_path / "merged", {}),
                "train": {**raw["train"], "init_from": str(tmp_path / "merged"), "run_dir": str(tmp_path / "m")},
            },
            init_source=init_source,
        )
    )
    assert rel_err(torch.tensor(trainer.evaluate()), torch.tensor(merged.evaluate())) <= RTOL
    trained = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 3 * 2 and all("lora" in name for name in trained)  # 2 layers: q, v, gate_up; A and B
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train_step()
    assert all(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters() if p.requires_grad)


def test_a_lora_run_merges_into_a_quantized_export(tmp_path, base, capsys):
    """`convert RUN DST --merge --quantize fp8` writes the same bytes as merging (`--merge`) and then
    quantizing that directory (`--quantize fp8`): the merged fp32 weights quantized in the
    published layout; without --merge a LoRA run is refused in one line."""
    raw = lora_raw(tmp_path, base, {"rank": 4, "alpha": 16.0}, steps=2, lr=5e-2, eval_every=0)
    train(config_from_dict(raw, init_source=init_source))
    run, merged, quantized, two_steps = (tmp_path / name for name in ("run", "merged", "fp8", "two-steps"))
    assert main(["convert", str(run), str(merged), "--merge"]) == 0
    assert main(["convert", str(run), str(quantized), "--merge", "--quantize", "fp8"]) == 0
    assert main(["convert", str(merged), str(two_steps), "--quantize", "fp8"]) == 0
    assert json.loads((quantized / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    one, two = load_file(quantized / "model.safetensors"), load_file(two_steps / "model.safetensors")
    assert one.keys() == two.keys() and any(name.endswith("weight_scale_inv") for name in one)
    for name in one:
        assert one[name].dtype == two[name].dtype and torch.equal(
            one[name].contiguous().view(torch.uint8), two[name].contiguous().view(torch.uint8)
        ), name
    capsys.readouterr()
    assert main(["convert", str(run), str(tmp_path / "x"), "--quantize", "fp8"]) == 2
    assert "holds LoRA adapters (add --merge)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
