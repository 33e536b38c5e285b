"""Training from a Hugging Face checkpoint (`train.init_from`), on 4 CPU processes (gloo), fp32.

- Tiny `transformers` Qwen3-MoE, Mixtral, DeepSeek-V3, GPT-OSS and Gemma-4 models, saved as
  sharded safetensors by transformers itself: `moemesh train --set train.init_from=DIR` takes its
  first step with transformers' cross-entropy on the same batch, in one process and under EP × TP,
  FSDP and PP × EP (each rank reading only its part). Tolerance 1e-5 relative: the same fp32
  function, summed in other orders (the layouts) and with other kernels (transformers').
- After a step with a negligible learning rate, `moemesh convert` gives back the source's tensors
  exactly, under the source's names, as transformers loads them.
- A model built on the meta device and laid out holds, in every layout, exactly the initial values
  of one process (`models/build.py`'s counter-based generator), every family, under FSDP too.
- Each bad `init_from` is one line and exit code 2.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from moemesh.checkpoint.load import init_source, load_model
from moemesh.cli import main
from moemesh.config import config_from_dict, dumps_toml, load_config
from moemesh.errors import ConfigError
from moemesh.train.trainer import Trainer
from test_models_deepseek import TINY as DEEPSEEK_TINY
from test_models_gemma4 import TINY as GEMMA4_TINY
from test_models_gemma4 import randomise_scales
from test_models_gpt_oss import TINY as GPT_OSS_TINY
from test_models_hf_parity import TINY as QWEN3_TINY
from tiny_run import tiny_raw, write_corpus

WORLD = 4
RTOL = 1e-5
TRAIN = {"steps": 1, "global_batch": 16, "micro_batch": 4, "seq_len": 32, "eval_every": 0, "save_every": 0}
LAYOUTS = {"one process": {}, "ep2-tp2": dict(ep=2, tp=2), "dp_shard4": dict(dp_shard=4), "pp2-ep2": dict(pp=2, ep=2)}
BYTES = dict(vocab_size=256)  # the byte tokenizer's vocabulary


def hf_models() -> dict:
    """Family -> a tiny transformers model (8 experts, heads that TP 2 divides)."""
    torch.manual_seed(0)
    qwen3 = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **{**QWEN3_TINY, **BYTES},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            norm_topk_prob=True,
        )
    )
    mixtral = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            **{**QWEN3_TINY, **BYTES}, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16
        )
    )
    deepseek = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(
            **{**DEEPSEEK_TINY, **BYTES},
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            q_lora_rank=12,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
    )
    with torch.no_grad():  # a correction bias that matters
        for name, buffer in deepseek.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    gpt_oss = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            **{**GPT_OSS_TINY, **BYTES}, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16
        )
    )
    with torch.no_grad():  # transformers starts the biases and sinks at zero: make them count
        for name, param in gpt_oss.named_parameters():
            if "bias" in name or name.endswith("sinks"):
                param.normal_(0.0, 0.3)
    gemma4 = randomise_scales(
        transformers.Gemma4ForCausalLM(
            transformers.Gemma4TextConfig(
                **{**GEMMA4_TINY, **BYTES},
                num_experts=8,
                top_k_experts=2,
                global_head_dim=16,
                final_logit_softcapping=3.0,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            )
        )
    )
    return {
        name: model.float().eval()
        for name, model in {
            "qwen3_moe": qwen3,
            "mixtral": mixtral,
            "deepseek_v3": deepseek,
            "gpt_oss": gpt_oss,
            "gemma4_text": gemma4,
        }.items()
    }


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Family -> (the transformers model, its directory, sharded in small safetensors files)."""
    directory = tmp_path_factory.mktemp("init_from")
    write_corpus(directory)
    out = {}
    for family, model in hf_models().items():
        model.save_pretrained(directory / family, max_shard_size="100KB")
        assert len(list((directory / family).glob("*.safetensors"))) > 1
        out[family] = model, directory / family
    return directory, out


def run_config(directory, source, layout: str, **train) -> dict:
    run_dir = train.pop("run_dir", directory / "runs" / f"{source.name}-{layout}")
    raw = tiny_raw(run_dir, directory / "corpus.txt", **{**TRAIN, **train})
    del raw["model"]  # the model is the checkpoint's
    raw["train"]["init_from"] = str(source)
    raw["parallel"] = LAYOUTS[layout]
    return raw


def first_step(rank, raw: dict) -> float:
    trainer = Trainer(config_from_dict(raw, init_source=init_source), io.StringIO())
    return trainer.train_step()["loss"]


def their_loss(model, raw: dict) -> float:
    """transformers' mean next-token cross-entropy over the first step's micro-batches."""
    trainer_config = config_from_dict(raw, init_source=init_source)
    from moemesh.data.dataset import load_dataset

    dataset, _ = load_dataset(trainer_config.data, trainer_config.train.seq_len, 0, 256)
    batch = dataset.train_sequences(0, trainer_config.train.global_batch)
    losses = []
    with torch.no_grad():
        for micro in batch.split(trainer_config.train.micro_batch):
            logits = model(input_ids=micro).logits
            losses.append(F.cross_entropy(logits[:, :-1].flatten(0, 1), micro[:, 1:].flatten()).item())
    return sum(losses) / len(losses)


FAMILIES = ["qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "gemma4_text"]


@pytest.mark.parametrize("family", FAMILIES)
def test_first_step_from_a_hugging_face_checkpoint_equals_transformers_in_every_layout(pool, sources, family):
    directory, models = sources
    theirs, source = models[family]
    expected = their_loss(theirs, run_config(directory, source, "one process"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours = {"one process": first_step(0, run_config(directory, source, "one process"))}
    finally:
        torch.set_num_threads(threads)
    for layout in list(LAYOUTS)[1:]:
        losses = pool.run(first_step, run_config(directory, source, layout))
        assert len(set(losses)) == 1, (layout, losses)  # every rank reports the step's one loss
        ours[layout] = losses[0]
    for layout, loss in ours.items():
        assert abs(loss - expected) <= RTOL * expected, (layout, loss, expected)


def test_convert_after_a_negligible_step_gives_back_the_source(sources, tmp_path):
    directory, models = sources
    theirs, source = models["qwen3_moe"]
    raw = run_config(directory, source, "one process", lr=1e-30, run_dir=str(tmp_path / "run"))
    Trainer(config_from_dict(raw, init_source=init_source), io.StringIO()).run()
    assert main(["convert", str(tmp_path / "run"), str(tmp_path / "back")]) == 0
    back = {}
    for file in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(file))
    written = {}
    for file in source.glob("*.safetensors"):
        written.update(load_file(file))
    assert back.keys() == written.keys()
    for name, tensor in written.items():
        assert torch.equal(back[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


def check_initial_values(rank, family: str, layout: dict) -> bool:
    """Laid out on the meta device and initialised piece by piece = one process's whole model."""
    from torch.distributed.tensor import DTensor

    from moemesh.models import build
    from moemesh.models.build import meta_model
    from moemesh.parallel.config import ParallelConfig, StepShape
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.parallelize import materialize, parallelize
    from moemesh.parallel.stored import stored_state
    from test_parallel_families import CONFIGS
    from test_parallel_fsdp import presented

    config = CONFIGS[family]
    mesh = init_mesh(ParallelDims(**layout))
    model = meta_model(config)
    parallelize(model, mesh, ParallelConfig(**layout), StepShape(dtype="float32"))
    materialize(model, "cpu", seed=7)
    pieces = stored_state({"model": dict(model.named_parameters())}, model, mesh)["model"]
    expected = {}
    for name, param in build(config, seed=7).named_parameters():
        expected.update(presented(name, param.detach()))
    assert pieces.keys() == expected.keys()
    for key, piece in pieces.items():
        assert torch.equal((piece.full_tensor() if isinstance(piece, DTensor) else piece).detach(), expected[key]), key
    return True


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "gemma4"])
@pytest.mark.parametrize(
    "layout",
    [dict(ep=2, tp=2), dict(dp_shard=2, tp=2), dict(dp_shard=2, ep=2)],
    ids=["ep2-tp2", "dp_shard2-tp2", "dp_shard2-ep2"],
)
def test_every_layout_initialises_the_values_of_one_process(pool, family, layout):
    assert all(pool.run(check_initial_values, family, layout))


def _fails(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_bad_init_from_is_one_line(sources, tmp_path, capsys):
    directory, models = sources
    _, source = models["qwen3_moe"]

    def train_from(path, *more):
        return _fails(
            capsys,
            [
                "train",
                "--set",
                f"train.init_from={path}",
                f"data.path={directory / 'corpus.txt'}",
                f"train.run_dir={tmp_path / 'run'}",
                *more,
            ],
        )

    assert f"checkpoint not found: {tmp_path / 'gone'}" in train_from(tmp_path / "gone")
    (tmp_path / "no_weights").mkdir()
    (tmp_path / "no_weights" / "config.json").write_text((source / "config.json").read_text())
    assert "config.json without weights" in train_from(tmp_path / "no_weights")

    def copy_with(name: str, **config_changes):
        copy = tmp_path / name
        copy.mkdir()
        for file in source.iterdir():
            (copy / file.name).write_bytes(file.read_bytes())
        config = json.loads((source / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**config, **config_changes}))
        return copy

    err = train_from(copy_with("unknown", model_type="qwen3_moee"))
    assert "unknown model_type 'qwen3_moee' (did you mean 'qwen3_moe'?)" in err
    truncated = copy_with("truncated")
    shard = sorted(truncated.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    assert f"{truncated}: cannot read" in train_from(truncated)
    err = train_from(copy_with("mismatch", moe_intermediate_size=8))
    assert "has shape" in err and "the config expects" in err

    err = train_from(source, "model.hidden_size=64")
    assert f"model.hidden_size = 64 contradicts train.init_from {source}" in err and "hidden_size = 32" in err


def test_init_from_takes_the_model_and_tokenizer_of_the_checkpoint(sources, tmp_path):
    directory, models = sources
    _, source = models["mixtral"]
    raw = run_config(directory, source, "one process")
    raw["model"] = {"output_router_logits": True, "router_aux_loss_coef": 0.05}  # how to train: allowed
    config = config_from_dict(raw, init_source=init_source)
    assert config.model.model_type == "mixtral" and config.model.hidden_size == 32
    assert config.model.output_router_logits and config.model.router_aux_loss_coef == 0.05
    assert config.data.tokenizer == "bytes"  # transformers wrote no tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{}")
    with_tokenizer = tmp_path / "with_tokenizer"
    with_tokenizer.mkdir()
    for file in source.iterdir():
        (with_tokenizer / file.name).write_bytes(file.read_bytes())
    (with_tokenizer / "tokenizer.json").write_text("{}")
    raw = run_config(directory, with_tokenizer, "one process")
    assert config_from_dict(raw, init_source=init_source).data.tokenizer == str(with_tokenizer / "tokenizer.json")
    assert config_from_dict(raw, init_source=init_source).tokenizer_origin == "train.init_from's"
    raw["data"]["tokenizer"] = "bytes"  # named: it wins
    assert config_from_dict(raw, init_source=init_source).data.tokenizer == "bytes"
    origin = f"data.tokenizer, not train.init_from's {with_tokenizer}/tokenizer.json"
    assert config_from_dict(raw, init_source=init_source).tokenizer_origin == origin

    # A config file's tokenizer is a default for a checkpoint named on the command line (the
    # README's fine-tuning command on configs/*.toml, which say "bytes"); --set data.tokenizer, or
    # a file that names the checkpoint too, chooses.
    file = tmp_path / "run.toml"
    file.write_text(dumps_toml({k: v for k, v in raw.items() if k != "model"}))
    file_without_source = tmp_path / "defaults.toml"
    without_source = {**raw, "train": {k: v for k, v in raw["train"].items() if k != "init_from"}}
    file_without_source.write_text(dumps_toml({k: v for k, v in without_source.items() if k != "model"}))
    init_from = f"train.init_from={with_tokenizer}"
    from_cli = load_config(file_without_source, [init_from], launched=False, init_source=init_source)
    assert from_cli.data.tokenizer == str(with_tokenizer / "tokenizer.json")
    assert from_cli.tokenizer_origin == "train.init_from's"
    chosen = load_config(file_without_source, [init_from, "data.tokenizer=bytes"], False, init_source)
    assert chosen.data.tokenizer == "bytes"
    assert load_config(file, [], launched=False, init_source=init_source).data.tokenizer == "bytes"
    raw["model"] = {"num_experts": 4}
    with pytest.raises(ConfigError, match="model.num_experts = 4 contradicts"):
        config_from_dict(raw, init_source=init_source)
    # The run config reads no checkpoint itself (it sits above checkpoint/ and imports none of it).
    with pytest.raises(ValueError, match="pass init_source="):
        config_from_dict(raw)


def test_init_from_a_moemesh_run_takes_its_weights_only(pool, sources, tmp_path):
    """A run directory as `init_from`: its newest checkpoint's weights, a fresh optimizer, step 0;
    the first step the same in one process and under EP × TP (each rank reading its pieces of the
    DCP checkpoint), and not the seed's first step."""
    directory, _ = sources
    first = tiny_raw(tmp_path / "first", directory / "corpus.txt", **{**TRAIN, "steps": 3})
    Trainer(config_from_dict(first), io.StringIO()).run()
    trained = load_model(tmp_path / "first")[0].state_dict()
    raw = tiny_raw(tmp_path / "second", directory / "corpus.txt", **TRAIN)
    del raw["model"]
    raw["train"]["init_from"] = str(tmp_path / "first")
    trainer = Trainer(config_from_dict(raw, init_source=init_source), io.StringIO())
    assert trainer.step == 0 and not trainer.optimizer.state
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    loss = trainer.train_step()["loss"]
    from_seed = first_step(0, {**first, "train": {**first["train"], "run_dir": str(tmp_path / "seed")}})
    assert abs(loss - from_seed) > 1e-3 * from_seed  # three steps of training show
    sharded = {**raw, "parallel": LAYOUTS["ep2-tp2"], "train": {**raw["train"], "run_dir": str(tmp_path / "ep2-tp2")}}
    for rank_loss in pool.run(first_step, sharded):
        assert abs(rank_loss - loss) <= RTOL * loss, (rank_loss, loss)
