"""The run config: TOML + overrides, unknown keys with suggestions, value checks, round trip."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from moemesh.config import DEFAULT_CONFIG, OTHER_NAMES, _all_keys, config_from_dict, load_config
from moemesh.errors import ConfigError
from tiny_run import tiny_raw

REPO_CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))


def test_the_default_is_the_tiny_config():
    config = load_config()
    assert DEFAULT_CONFIG.name == "tiny.toml"
    assert config.model.model_type == "qwen3_moe"
    assert config.model.num_experts >= 8 and config.model.num_experts_per_tok == 2
    assert config.model.output_router_logits
    assert (config.data.path, config.data.tokenizer) == ("stdlib", "bytes")


@pytest.mark.parametrize("path", REPO_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_is_valid(path):
    load_config(path, launched=False)  # the multi-GPU ones are checked here without their processes


def test_overrides_are_toml_values_or_bare_strings():
    config = load_config(
        None,
        [
            "train.lr=1e-4",
            "train.resume=true",
            "data.path=some/file.txt",
            "train.betas=[0.8, 0.99]",
            "model.num_experts=16",
        ],
    )
    assert config.train.lr == 1e-4 and config.train.resume is True
    assert config.data.path == "some/file.txt"
    assert config.train.betas == [0.8, 0.99]
    assert config.model.num_experts == 16


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.step=5", "unknown config key 'train.step' (did you mean 'train.steps'?)"),
        ("model.num_expert=4", "unknown config key 'model.num_expert' (did you mean 'model.num_experts'?)"),
        (
            "trian.steps=5",
            "unknown config section [trian] (did you mean [train]?); sections: model, parallel, train, data, lora",
        ),
        ("parallel.ep_size=2", "unknown config key 'parallel.ep_size' (did you mean 'parallel.ep'?)"),
        # Other trainers' names, which spelling alone takes elsewhere (learning_rate -> min_lr_ratio):
        ("train.learning_rate=1e-3", "unknown config key 'train.learning_rate' (did you mean 'train.lr'?)"),
        ("train.lr_warmup_steps=5", "unknown config key 'train.lr_warmup_steps' (did you mean 'train.warmup_steps'?)"),
        ("train.batch_size=8", "unknown config key 'train.batch_size' (did you mean 'train.global_batch'?)"),
        ("train.max_steps=5", "unknown config key 'train.max_steps' (did you mean 'train.steps'?)"),
        ("model.learning_rate=1e-3", "unknown config key 'model.learning_rate' (did you mean 'train.lr'?)"),
    ],
)
def test_unknown_keys_name_the_closest_valid_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value) == message


def test_override_without_section_is_rejected():
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        load_config(None, ["steps=5"])


def test_a_key_outside_any_section_finds_its_section(tmp_path):
    path = tmp_path / "flat.toml"
    path.write_text("steps = 5\n")
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value) == "unknown config key 'steps' (did you mean 'train.steps'?)"


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.steps=abc", "train.steps must be of type int, got 'abc'"),
        ("train.resume=1", "train.resume must be of type bool, got 1"),
        ("train.steps=0", "train.steps must be >= 1, got 0"),
        ("train.save_every=-2", "train.save_every must be >= -1, got -2"),
        ("train.router_bias_update_rate=-0.001", "train.router_bias_update_rate must be >= 0, got -0.001"),
        ("train.dtype=float16", "train.dtype must be 'auto', 'float32' or 'bfloat16'"),
        ("model.num_experts_per_tok=9", "num_experts_per_tok (9) must be <= num_experts (8)"),
        ("train.global_batch=12", "train.global_batch (12) must be divisible by train.micro_batch (8)"),
        (
            "parallel.dp_shard=3",
            "train.micro_batch (8) must be divisible by the data-parallel size "
            "(parallel.dp_replicate × parallel.dp_shard × parallel.ep = 3)",
        ),
        ("train.seq_len=4096", "train.seq_len (4096) exceeds model.max_position_embeddings (1024)"),
        (
            "parallel.ep=2",
            "the layout parallel.dp_replicate × dp_shard × ep × tp × pp needs 2 processes, but 1 were launched",
        ),
        (
            "parallel.tp=2",
            "the layout parallel.dp_replicate × dp_shard × ep × tp × pp needs 2 processes, but 1 were launched",
        ),
        ("parallel.tp=3", "parallel.tp (3) must divide model.num_attention_heads (4)"),
        (  # 4 ranks take 2 key/value heads (a copy each), not 6
            "parallel.tp=4 model.num_attention_heads=12 model.num_key_value_heads=6",
            "parallel.tp (4) must divide model.num_key_value_heads (6) or be a multiple of it",
        ),
        ("parallel.tp=2 model.vocab_size=257", "parallel.tp (2) must divide model.vocab_size (257)"),
        (
            "parallel.pp=2",
            "parallel.pp_schedule = 'dualpipev' with parallel.pp=2 needs at least 4 micro-batches per "
            "step, got train.global_batch / train.micro_batch = 16 / 8 = 2",
        ),
        ("parallel.pp=2 parallel.pp_schedule=zb", "unknown pipeline schedule 'zb'; known: dualpipev, 1f1b"),
        ("parallel.pp_overlap=yes", "parallel.pp_overlap must be of type bool, got 'yes'"),
        ("data.val_fraction=1.5", "data.val_fraction must be in (0, 1)"),
        (
            "train.cuda_graphs=true parallel.ep=2 parallel.tp=2",
            "train.cuda_graphs captures the step of one process or of expert parallelism alone; not with "
            "parallel.tp = 2",
        ),
        (
            "train.cuda_graphs=true parallel.ep=2 parallel.ep_dispatch=all_to_all",
            'train.cuda_graphs under expert parallelism needs parallel.ep_dispatch = "gather"',
        ),
        (
            "train.cuda_graphs=true lora.rank=4",
            "train.cuda_graphs with adapters on the experts needs lora.rank a multiple of 8 (got 4)",
        ),
        (
            "train.cuda_graphs=true lora.rank=8 lora.dropout=0.1",
            "train.cuda_graphs replays the same random numbers every step: set lora.dropout = 0 (got 0.1)",
        ),
        (
            'train.report_to=["tensorbord"]',
            "train.report_to: unknown 'tensorbord' (did you mean 'tensorboard'?); choose from tensorboard, wandb",
        ),
        ('train.report_to=["wandb","wandb"]', "train.report_to names 'wandb' twice"),
        ("train.report_to=wandb", "train.report_to must be of type list[str], got 'wandb'"),
    ],
)
def test_invalid_values_are_named(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, override.split())
    assert message in str(error.value)


def test_a_report_to_whose_package_is_missing_names_the_pip_command(monkeypatch):
    """Said when the config is read, before any model is built or weight read."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as error:
        load_config(None, ['train.report_to=["tensorboard", "wandb"]'])
    assert str(error.value) == (
        "train.report_to includes 'wandb', but wandb is not installed: "
        "pip install wandb (or pip install 'moemesh[tracking]')"
    )
    assert load_config(None, ['train.report_to=["tensorboard"]']).train.report_to == ["tensorboard"]
    assert load_config().train.report_to == []  # the default: metrics.jsonl alone


def test_the_number_of_processes_must_match_the_layout(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(
        ConfigError,
        match=r"needs 1 processes, but 4 were launched \(WORLD_SIZE=4\); "
        r"use torchrun --nproc-per-node 1",
    ):
        load_config()
    load_config(None, ["parallel.ep=4"])  # the expert-parallel layout of four processes


def test_missing_and_malformed_config_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_resolved_config_round_trips_through_toml(tmp_path):
    config = config_from_dict(tiny_raw(tmp_path / "run", tmp_path / "data.txt"))
    again = config_from_dict(tomllib.loads(config.to_toml()))
    assert again == config


def test_other_trainers_names_point_at_real_keys():
    """Each name another trainer uses points at a key that exists, and none is one of ours."""
    keys = _all_keys()
    names = {key.rpartition(".")[2] for key in keys}
    assert all(target in keys for target in OTHER_NAMES.values())
    assert not names & OTHER_NAMES.keys()
