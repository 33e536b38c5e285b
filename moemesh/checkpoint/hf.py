"""Read and write Hugging Face model directories: `config.json` plus `*.safetensors` (one file or
shards with `model.safetensors.index.json`).

Two expert layouts are read: the fused one of transformers 5 (`mlp.experts.gate_up_proj`) and
the per-expert one of the original Hub checkpoints (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`). We write the per-expert one, which every transformers
version loads. Multimodal checkpoints (Gemma-4's) load their language model (`multimodal.py`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moemesh.errors import CheckpointError
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family
from moemesh.checkpoint.multimodal import WRAPPERS, Multimodal
from moemesh.models.registry import family
from moemesh.models.transformer import MoECausalLM

INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_log = logging.getLogger(__name__)


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, Multimodal | None]:
    """The model config and, for a multimodal checkpoint, what wraps its language model."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        hf = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_file}: not valid JSON ({error})") from None
    wrapper = WRAPPERS.get(hf.get("model_type"))
    return ModelConfig.from_hf_dict(wrapper.text_config(hf) if wrapper else hf), wrapper


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> MoECausalLM:
    """Load a model directory written by transformers' `save_pretrained` (or by ours). With
    dtype=None the weights keep the dtype named in config.json (float32 if none is named)."""
    config, wrapper = read_config(path)
    if dtype is None:
        dtype = _DTYPES.get(config.extra.get("dtype") or config.extra.get("torch_dtype"), torch.float32)
    with torch.device("meta"):
        model = MoECausalLM(config)
    tensors = read_safetensors(Path(path), family(config.model_type), config, wrapper)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
        tensors.pop("lm_head.weight", None)
    for name, param in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: missing weight {name!r} (shape {tuple(param.shape)})")
        if tensors[name].shape != param.shape:
            raise CheckpointError(f"{path}: weight {name!r} has shape {tuple(tensors[name].shape)}, "
                                  f"the config expects {tuple(param.shape)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise CheckpointError(f"{path}: unexpected weight {unexpected[0]!r} (not in a {config.model_type} "
                              f"model with this config; {len(unexpected)} such weights)")
    # DeepSeek-V3's correction bias stays fp32, as in transformers (see GroupLimitedRouter)
    state = {name: t.to(device=device or "cpu", dtype=torch.float32 if name.endswith("e_score_correction_bias")
                        else dtype) for name, t in tensors.items()}
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    return model


def read_safetensors(path: Path, fam: Family, config: ModelConfig,
                     wrapper: Multimodal | None = None) -> dict[str, torch.Tensor]:
    """All tensors of the directory under moemesh's (= transformers 5's) names, experts fused; of a
    multimodal checkpoint (`wrapper`), those of its language model."""
    tensors, skipped = {}, 0
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt") as reader:
                for key in reader.keys():
                    name = key if wrapper is None else wrapper.text_name(key)
                    if name is None:
                        skipped += 1
                        continue
                    tensors[_rename_moe_prefix(name, fam)] = reader.get_tensor(key)
        except CheckpointError as error:  # a weight that belongs nowhere
            raise CheckpointError(f"{file}: {error}") from None
        except Exception as error:  # safetensors raises its own types for truncated/corrupt files
            raise CheckpointError(f"{file}: cannot read safetensors file ({error})") from None
    if skipped:
        _log.warning(f"{path}: loading the language model of a {wrapper.architecture} checkpoint; skipped {skipped} "
                     f"tensors of its parts moemesh does not model ({', '.join(wrapper.skipped_prefixes)})")
    if fam.state_from_hf is not None:
        return fam.state_from_hf(tensors, config)
    return _fuse_experts(tensors, fam, config)


def _weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names a shard that does not exist: {missing[0]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights found")
    return files


def _rename_moe_prefix(key: str, fam: Family) -> str:
    return key.replace(f".{fam.hub_moe_prefix}.", ".mlp.") if fam.hub_moe_prefix != "mlp" else key


_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight$")


def _fuse_experts(tensors: dict[str, torch.Tensor], fam: Family, config: ModelConfig) -> dict[str, torch.Tensor]:
    per_expert: dict[str, dict[tuple[str, int], torch.Tensor]] = defaultdict(dict)
    fused = {}
    for key, tensor in tensors.items():
        match = _PER_EXPERT.match(key)
        if match and match.group(3) in fam.hub_expert_names:
            per_expert[match.group(1)][(match.group(3), int(match.group(2)))] = tensor
        else:
            fused[key] = tensor
    gate_name, up_name, down_name = fam.hub_expert_names
    for prefix, pieces in per_expert.items():
        def piece(name: str, j: int) -> torch.Tensor:
            if (name, j) not in pieces:
                raise CheckpointError(f"missing weight {prefix}.{j}.{name}.weight")
            return pieces[(name, j)]

        experts = range(config.num_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([piece(gate_name, j), piece(up_name, j)]) for j in experts])
        fused[f"{prefix}.down_proj"] = torch.stack([piece(down_name, j) for j in experts])
        extra = sorted(j for _, j in pieces if j >= config.num_experts)
        if extra:
            raise CheckpointError(f"unexpected weight {prefix}.{extra[0]}.* (config has {config.num_experts} experts)")
    return fused


def to_hub_layout(model: MoECausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under the original per-expert Hub names."""
    fam = family(model.config.model_type)
    gate_name, up_name, down_name = fam.hub_expert_names
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    if fam.state_to_hf is not None:
        return {name: t.detach().cpu().contiguous() for name, t in fam.state_to_hf(state, model.config).items()}
    out = {}
    for name, tensor in state.items():
        in_moe_block = ".mlp.experts." in name or ".mlp.gate." in name
        hub_name = name.replace(".mlp.", f".{fam.hub_moe_prefix}.") if in_moe_block else name
        if name.endswith(".experts.gate_up_proj"):
            prefix = hub_name.removesuffix(".gate_up_proj")
            for j, (gate, up) in enumerate(t.chunk(2) for t in tensor):
                out[f"{prefix}.{j}.{gate_name}.weight"] = gate
                out[f"{prefix}.{j}.{up_name}.weight"] = up
        elif name.endswith(".experts.down_proj"):
            prefix = hub_name.removesuffix(".down_proj")
            for j, down in enumerate(tensor):
                out[f"{prefix}.{j}.{down_name}.weight"] = down
        else:
            out[hub_name] = tensor
    return {name: t.detach().cpu().contiguous() for name, t in out.items()}


def save_pretrained(model: MoECausalLM, path: str | os.PathLike, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and safetensors shards that transformers' `from_pretrained` loads. Each
    file is written under a temporary name and renamed when complete."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = to_hub_layout(model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _atomic_write(path / name, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": {key: name for name, shard in zip(names, shards) for key in shard}}
        _atomic_write(path / INDEX_FILE, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
    hf_config = model.config.to_hf_dict()
    hf_config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2) + "\n"))


def _atomic_write(target: Path, write) -> None:
    tmp = target.with_name(target.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, target)
