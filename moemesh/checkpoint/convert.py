"""Conversions between moemesh checkpoints and Hugging Face directories, and loading either as
a whole model (`moemesh convert`, `generate` on one process, the tests' oracle)."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from moemesh.checkpoint import integrity
from moemesh.checkpoint.dcp import TOKENIZER_FILE, _load, resolve_checkpoint, save_checkpoint
from moemesh.checkpoint.hf import from_pretrained, save_pretrained
from moemesh.errors import CheckpointError
from moemesh.models import ModelConfig, build
from moemesh.parallel.stored import stored_state


def is_hf_directory(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_model_config(path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a complete checkpoint (no config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / 'config.json'}: not valid JSON ({e})") from None


def load_model(path: str | os.PathLike, device: torch.device | str = "cpu") -> tuple[nn.Module, Path]:
    """The model of a moemesh checkpoint (or run directory) or of a Hugging Face directory, in
    float32. Returns it with the directory it came from."""
    if is_hf_directory(path):
        return from_pretrained(path, dtype=torch.float32, device=device), Path(path)
    path = resolve_checkpoint(path)
    model = build(read_model_config(path), device=device)
    _load(path, stored_state({"model": model.state_dict()}))  # in place, into the parameters
    return model, path


def export_hf(source: str | os.PathLike, target: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """moemesh checkpoint -> Hugging Face directory (config.json + safetensors), written under a
    temporary name and renamed when complete."""
    _check_target(target)
    model, checkpoint = load_model(source)
    if dtype is not None:
        model.to(dtype)
    target = Path(target)
    tmp = target.with_name(integrity.TMP_PREFIX + target.name)
    with _writing(target, tmp):
        save_pretrained(model, tmp)
        if (checkpoint / TOKENIZER_FILE).is_file():
            shutil.copyfile(checkpoint / TOKENIZER_FILE, tmp / TOKENIZER_FILE)
        integrity.publish(tmp, target)
    return checkpoint


def import_hf(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Hugging Face directory -> moemesh checkpoint holding the model."""
    if not is_hf_directory(source):
        raise CheckpointError(f"{source} is not a Hugging Face model directory (config.json + *.safetensors)")
    _check_target(target)
    model = from_pretrained(source, dtype=torch.float32)
    tokenizer = Path(source) / TOKENIZER_FILE
    target = Path(target)
    with _writing(target, target.with_name(integrity.TMP_PREFIX + target.name)):  # save_checkpoint's own
        save_checkpoint(target, {"model": model.state_dict()}, model.config, tokenizer if tokenizer.is_file() else None)


def _check_target(target: str | os.PathLike) -> None:
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory; choose a new directory")
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} already exists and is not empty; choose a new directory")


@contextmanager
def _writing(target: Path, tmp: Path):
    """A write into `tmp` that fails (no space, no permission, no such directory) leaves nothing
    behind and says so in one line."""
    try:
        yield
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write {target}: {e.strerror or e}") from None
