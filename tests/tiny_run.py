"""A tiny model, corpus and run config for the training, CLI and generation tests: a 20-step run
takes about a second on two CPU cores."""

from __future__ import annotations

import json.decoder
import string
import textwrap
from pathlib import Path

from moemesh.config import RunConfig, config_from_dict, dumps_toml

TINY_MODEL = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "max_position_embeddings": 128,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}

TINY_TRAIN = {
    "steps": 20,
    "global_batch": 4,
    "micro_batch": 2,
    "seq_len": 32,
    "lr": 1e-2,
    "warmup_steps": 3,
    "eval_every": 10,
    "eval_sequences": 4,
    "save_every": 10,
    "device": "cpu",
}


def write_corpus(directory: Path) -> Path:
    """About 70 kB of Python source as one UTF-8 text file."""
    path = directory / "corpus.txt"
    path.write_text("".join(Path(module.__file__).read_text() for module in (json.decoder, textwrap, string)))
    return path


def tiny_raw(run_dir: Path, data_path: Path, **train) -> dict:
    return {
        "model": dict(TINY_MODEL),
        "train": {**TINY_TRAIN, "run_dir": str(run_dir), **train},
        "data": {"path": str(data_path)},
    }


def tiny_config(run_dir: Path, data_path: Path, **train) -> RunConfig:
    return config_from_dict(tiny_raw(run_dir, data_path, **train))


def write_tiny_toml(directory: Path, **train) -> Path:
    """A config file for a tiny run in directory/run on directory/corpus.txt."""
    path = directory / "tiny.toml"
    path.write_text(dumps_toml(tiny_raw(directory / "run", write_corpus(directory), **train)))
    return path
