"""`moemesh convert`: moemesh checkpoints to Hugging Face directories and back.

A moemesh checkpoint (or a run directory's newest) becomes config.json + safetensors by reading one
tensor at a time from torch.distributed.checkpoint — whatever layout wrote it, however many ranks —
and writing each safetensors shard once full: memory holds one tensor and one shard, never the
model. A Hugging Face directory becomes a checkpoint of its model in the dtype it is stored in (a
quantized one: its weights dequantized, in float32, where they are exact), or in the one asked for.

Either kind becomes a quantized Hugging Face directory (`export_quantized`: block FP8 or MXFP4, in
the family's published layout, `checkpoint/quantized_layout.py`), streamed too: one tensor at a
time is read whole, quantized and written. Weights that came quantized, dequantized in float32,
are written back with the same bytes (the exceptions, encodings that their values alone cannot
tell apart, and BF16 scales written F32: `quantized.py`).

A LoRA run's checkpoint (adapters only, `checkpoint/adapters.py`) becomes a PEFT adapter directory,
or with `merge` a Hugging Face model of its base with the adapters folded in (the base read whole
on the host, in its own dtype, each weight merged in fp32).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from moemesh.checkpoint import integrity
from moemesh.checkpoint.adapters import PEFT_CONFIG, read_adapter, read_adapter_base, write_peft
from moemesh.checkpoint.dcp import TOKENIZER_FILE, _load, resolve_checkpoint, save_checkpoint, tokenizer_files
from moemesh.checkpoint.hf import read_config, save_pretrained, write_pretrained
from moemesh.checkpoint.load import hf_state, is_hf_directory, load_model, read_hf_tensor, read_model_config
from moemesh.checkpoint.quantized_layout import QuantizedWriter
from moemesh.errors import CheckpointError
from moemesh.models import ModelConfig
from moemesh.models.build import build, meta_model
from moemesh.models.lora import merge_adapters
from moemesh.parallel.stored import HALVES, packed_dim, stored_state


def export_hf(source: str | os.PathLike, target: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """moemesh checkpoint -> Hugging Face directory (config.json + safetensors), streamed, written
    under a temporary name and renamed when complete."""
    _check_target(target)
    checkpoint = resolve_checkpoint(source)  # the config of the checkpoint read: a newer one may not verify
    config = read_model_config(checkpoint)
    target = Path(target)
    tmp = target.with_name(integrity.TMP_PREFIX + target.name)
    with _writing(target, tmp):
        write_pretrained(_stored_tensors(checkpoint, config, dtype), config, tmp)
        tokenizer = checkpoint / TOKENIZER_FILE
        for name, file in tokenizer_files(tokenizer if tokenizer.is_file() else None).items():
            shutil.copyfile(file, tmp / name)
        integrity.publish(tmp, target)
    return checkpoint


def _stored_tensors(
    checkpoint: Path, config: ModelConfig, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight of the model, whole, read from the checkpoint one at a time (in `dtype`)."""
    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    names = meta_model(config).state_dict()
    if config.tie_word_embeddings:
        names.pop("lm_head.weight")
    for name, like in names.items():
        keys = [f"{name}.{half}" for half in HALVES] if packed_dim(name) is not None else [name]
        missing = [key for key in keys if f"model.{key}" not in stored]
        if missing:
            raise CheckpointError(f"{checkpoint}: no weight {missing[0]!r} in the checkpoint")
        tensor = torch.empty(like.shape, dtype=stored[f"model.{keys[0]}"].properties.dtype)
        # read in place: a packed tensor's stored halves are views of it
        _load(checkpoint, stored_state({"model": {name: tensor}}))
        yield name, tensor if dtype is None else tensor.to(dtype)


def export_adapter(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """A LoRA run's checkpoint -> a PEFT adapter directory; returns the checkpoint read."""
    _check_target(target)
    checkpoint = resolve_checkpoint(source)
    config = read_model_config(checkpoint)
    adapter = read_adapter(checkpoint, config)
    target = Path(target)
    tmp = target.with_name(integrity.TMP_PREFIX + target.name)
    with _writing(target, tmp):
        write_peft(adapter, config, tmp)
        integrity.publish(tmp, target)
    return checkpoint


def export_merged(
    source: str | os.PathLike,
    target: str | os.PathLike,
    base: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
) -> Path:
    """A LoRA run's checkpoint or a PEFT adapter directory, merged into its base (`base`, default
    the one the run started from: its train.init_from, else its seed's weights) -> a Hugging Face
    directory, with `quantize` ("fp8", "mxfp4") in that published layout, quantized from the merged
    fp32 weights (the unquantized tensors then in `dtype`). Returns the base directory read (None
    for a seed's)."""
    _check_target(target)
    adapter_dir = Path(source)
    if (adapter_dir / PEFT_CONFIG).is_file():
        base = base or read_adapter_base(adapter_dir)
        if base is None:
            raise CheckpointError(f"{source} names no base model (base_model_name_or_path): pass --base DIR")
    else:
        adapter_dir = resolve_checkpoint(source)
    if base is not None:
        model, _ = load_model(base)
        adapter = read_adapter(adapter_dir, model.config)
    else:
        config = read_model_config(adapter_dir)
        adapter = read_adapter(adapter_dir, config)
        if adapter.base is not None:
            model, _ = load_model(adapter.base)
            base = adapter.base
        else:  # a run from the seed: its base is the seed's initial weights
            model = build(config, seed=adapter.seed)
    if quantize:
        QuantizedWriter(quantize, model.config)  # a method or family it cannot write: refused before merging
    adapter.attach(model)
    adapter.load_into(model)
    merge_adapters(model)
    target = Path(target)
    tmp = target.with_name(integrity.TMP_PREFIX + target.name)
    with _writing(target, tmp):
        save_pretrained(model, tmp, quantize=quantize, dtype=dtype)
        tokenizer = Path(base) / TOKENIZER_FILE if base is not None else None
        if tokenizer is not None and tokenizer.is_file():
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
        integrity.publish(tmp, target)
    return Path(base) if base is not None else None


def export_quantized(
    source: str | os.PathLike, target: str | os.PathLike, method: str, dtype: torch.dtype | None = None
) -> Path:
    """A Hugging Face directory (quantized or not), a moemesh checkpoint or a run directory -> a
    Hugging Face directory quantized by `method` ("fp8", "mxfp4") in the family's published
    layout, its unquantized tensors in `dtype` (default: as stored). Streamed; written under a
    temporary name and renamed when complete. Returns the directory read."""
    _check_target(target)
    hf = is_hf_directory(source)
    checkpoint = Path(source) if hf else resolve_checkpoint(source)
    config = read_config(checkpoint)[0] if hf else read_model_config(checkpoint)
    QuantizedWriter(method, config)  # a method or family it cannot write: refused before writing
    tensors = _hf_tensors(checkpoint, config) if hf else _stored_tensors(checkpoint, config, None)
    target = Path(target)
    tmp = target.with_name(integrity.TMP_PREFIX + target.name)
    with _writing(target, tmp):
        write_pretrained(tensors, config, tmp, quantize=method, dtype=dtype)
        tokenizer = checkpoint / TOKENIZER_FILE
        for name, file in tokenizer_files(tokenizer if tokenizer.is_file() else None).items():
            shutil.copyfile(file, tmp / name)
        integrity.publish(tmp, target)
    return checkpoint


def _hf_tensors(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Each weight of a Hugging Face directory's model, whole, read one at a time (a quantized one
    dequantized in float32)."""
    for name, lazy in hf_state(path, config).items():
        tensor = torch.empty(lazy.shape, dtype=lazy.dtype)
        read_hf_tensor(path, name, lazy, tensor)
        yield name, tensor


def import_hf(source: str | os.PathLike, target: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
    """Hugging Face directory -> moemesh checkpoint holding the model (in `dtype`, default its
    stored dtype; a quantized directory's: float32)."""
    if not is_hf_directory(source):
        raise CheckpointError(f"{source} is not a Hugging Face model directory (config.json + *.safetensors)")
    _check_target(target)
    model, _ = load_model(source, dtype=dtype)
    tokenizer = Path(source) / TOKENIZER_FILE
    save_checkpoint(
        Path(target), {"model": model.state_dict()}, model.config, tokenizer if tokenizer.is_file() else None
    )


def _check_target(target: str | os.PathLike) -> None:
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} exists and is not a directory; choose a new directory")
    if target.exists() and any(target.iterdir()):
        raise CheckpointError(f"{target} already exists and is not empty; choose a new directory")


@contextmanager
def _writing(target: Path, tmp: Path):
    """A write into `tmp` that fails (no space, no permission, no such directory) leaves nothing
    behind and says so in one line; so does one whose source fails to read."""
    try:
        yield
    except BaseException as e:  # a source that fails to read half-way too: no half-written target
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write {target}: {e.strerror or e}") from None
        raise
