"""Reading a checkpoint into a model that is already laid out (`parallel/parallelize.py`) and
allocated: each rank reads only its part of each tensor — its experts, its TP slices, its FSDP
shards, its pipeline stages — straight into the tensor it keeps, in that tensor's device and dtype.
So a bf16 model goes to the GPU tensor by tensor, never through a float32 copy of the whole model
on the host, and a model larger than any one GPU loads into many.

Two sources, told apart by what the directory holds:
- a Hugging Face directory (config.json + safetensors, sharded or not, fused or per-expert
  experts, multimodal wrappers, quantized in block FP8 or MXFP4): read by slices through
  `lazy.py` (a quantized tensor: the elements and tile scales of the slice, `quantized.py`);
- a moemesh checkpoint or run directory (its newest checkpoint): torch.distributed.checkpoint
  reads the pieces a layout presents (`parallel/stored.py`); only the model, no optimizer state.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from moemesh.checkpoint.dcp import CHECKPOINTS, TOKENIZER_FILE, _load, checkpoint_steps, resolve_checkpoint
from moemesh.checkpoint.hf import DTYPES, read_config, read_quantization, read_state
from moemesh.checkpoint.lazy import Lazy
from moemesh.errors import CheckpointError
from moemesh.models import ModelConfig, MoECausalLM
from moemesh.models.build import meta_model
from moemesh.models.lora import is_adapter
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.parallelize import materialize
from moemesh.parallel.pieces import local_view
from moemesh.parallel.stored import stored_state


def is_hf_directory(path: str | os.PathLike) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_model_config(path: str | os.PathLike) -> ModelConfig:
    """The model config of a Hugging Face directory, a moemesh checkpoint or a run directory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    if is_hf_directory(path):
        return read_config(path)[0]
    if (path / "config.json").is_file() and not any(path.glob(".metadata")) and not any(path.glob("*.distcp")):
        raise CheckpointError(f"{path}: config.json without weights (no *.safetensors, and not a moemesh checkpoint)")
    checkpoint = newest_directory(path)
    try:
        return ModelConfig.from_hf_dict(json.loads((checkpoint / "config.json").read_text()))
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no config.json)") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{checkpoint / 'config.json'}: not valid JSON ({e})") from None


def init_source(path: str | os.PathLike) -> tuple[ModelConfig, Path | None]:
    """What a run that starts from this checkpoint (`train.init_from`) takes of it before its
    weights: its model config, and its tokenizer.json (None without one). `config.load_config`
    takes this function, so that the run config reads a checkpoint without importing this layer."""
    model = read_model_config(path)
    tokenizer = newest_directory(path) / TOKENIZER_FILE
    return model, tokenizer if tokenizer.is_file() else None


def weights_directory(path: str | os.PathLike) -> Path:
    """The directory whose files hold the weights: a Hugging Face directory or checkpoint itself,
    a run directory's newest checkpoint that verifies (collective under a process group)."""
    return Path(path) if is_hf_directory(path) else resolve_checkpoint(path)


def newest_directory(path: str | os.PathLike) -> Path:
    """`weights_directory` without reading the weights to verify them: for what every checkpoint of
    a run shares (its config.json, its tokenizer.json) before the weights are read."""
    steps = checkpoint_steps(path) if (Path(path) / CHECKPOINTS).is_dir() else [(0, Path(path))]
    if not steps:
        raise CheckpointError(f"no complete checkpoint in {Path(path) / CHECKPOINTS}")
    return steps[0][1]


@torch.no_grad()
def load_weights(model: MoECausalLM, path: str | os.PathLike, mesh: Mesh | None = None) -> Path:
    """Read this rank's part of every weight of `model` (laid out on `mesh`, allocated) from the
    checkpoint at `path`; returns the directory read (a run directory's newest checkpoint)."""
    directory = weights_directory(path)
    if is_hf_directory(directory):
        _load_hf(model, directory)
    else:
        base = {name: t for name, t in model.state_dict().items() if not is_adapter(name)}  # LoRA's start afresh
        _load(directory, stored_state({"model": base}, model, mesh))  # in place
    return directory


def _load_hf(model: MoECausalLM, path: Path) -> None:
    tensors = hf_state(path, model.config)
    for name, target in model.state_dict(keep_vars=True).items():
        if name in tensors:  # not the tied head
            local, _, index = local_view(target)
            read_hf_tensor(path, name, tensors[name], local, index)


def read_hf_tensor(path: Path, name: str, tensor: Lazy, into: torch.Tensor, index=None) -> None:
    """Read `tensor` (its block `index`; None: whole) into `into`, a damaged file named in one line."""
    try:
        tensor.read_into(into, index)
    except Exception as error:  # a file truncated or damaged after its header
        raise CheckpointError(f"{path}: cannot read {name!r} ({error})") from None


def hf_state(path: Path, model_config: ModelConfig) -> dict[str, Lazy]:
    """Every weight of a `model_config` model in the Hugging Face directory `path`, unread, under
    moemesh's names (not the tied head); CheckpointError for one missing, of another shape, or
    beyond the model."""
    config, wrapper = read_config(path)
    if config.model_type != model_config.model_type:
        raise CheckpointError(f"{path} holds a {config.model_type} model, not {model_config.model_type}")
    tensors = read_state(path, config, wrapper)
    # What the whole model holds (a rank may hold part of it): names and shapes.
    expected = {name: t.shape for name, t in meta_model(model_config).state_dict().items()}
    if model_config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: missing weight {name!r} (shape {tuple(shape)})")
        if tensors[name].shape != shape:
            raise CheckpointError(
                f"{path}: weight {name!r} has shape {tuple(tensors[name].shape)}, the config expects {tuple(shape)}"
            )
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(
            f"{path}: unexpected weight {unexpected[0]!r} (not in a {config.model_type} "
            f"model with this config; {len(unexpected)} such weights)"
        )
    return tensors


def load_model(
    path: str | os.PathLike, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> tuple[nn.Module, Path]:
    """The whole model of a Hugging Face directory (in `dtype`, default the one its config.json
    names, else float32; a quantized one's: float32, where its dequantized weights are exact) or
    of a moemesh checkpoint or run directory (default float32), with the directory it came from.
    One process; no host copy beyond the tensor being read."""
    config = read_model_config(path)
    if dtype is None:
        hf = is_hf_directory(path) and read_quantization(path) is None
        named = config.extra.get("dtype") or config.extra.get("torch_dtype") if hf else None
        dtype = DTYPES.get(named, torch.float32)
    model = materialize(meta_model(config, dtype), device)
    return model, load_weights(model, path)


def from_pretrained(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> MoECausalLM:
    """A Hugging Face model directory (written by transformers' `save_pretrained` or ours), whole."""
    if not is_hf_directory(path):
        raise CheckpointError(f"{path} is not a Hugging Face model directory (config.json + *.safetensors)")
    return load_model(path, device or "cpu", dtype)[0]
