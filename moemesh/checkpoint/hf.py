"""Read and write Hugging Face model directories: `config.json` plus `*.safetensors` (one file or
shards with `model.safetensors.index.json`).

Two expert layouts are read: the fused one of transformers 5 (`mlp.experts.gate_up_proj`) and
the per-expert one of the original Hub checkpoints (`mlp.experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`). We write the per-expert one, which every transformers
version loads. Multimodal checkpoints (Gemma-4's) load their language model (`multimodal.py`).
Quantized ones (config.json's `quantization_config`: gpt-oss's MXFP4, block FP8) are read
dequantized (`quantized_layout.py`), any other method refused before a tensor is read; written
quantized on request, in their families' published layout.

Reading is lazy (`lazy.py`): `read_state` gives every tensor of the language model under moemesh's
name, fused and re-laid as the family wants, but reads nothing; a rank then reads its block of each
(`load.py`). Writing streams: `write_pretrained` takes tensors one at a time and writes each
safetensors shard once it is full, so a checkpoint is converted without the model in memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from moemesh.checkpoint.lazy import Lazy, SafetensorsFiles
from moemesh.checkpoint.multimodal import WRAPPERS, Multimodal
from moemesh.checkpoint.quantized import Scheme, scheme_of
from moemesh.checkpoint.quantized_layout import QuantizedWriter, dequantized
from moemesh.errors import CheckpointError
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family
from moemesh.models.registry import family
from moemesh.models.transformer import MoECausalLM

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_log = logging.getLogger(__name__)


def read_config(path: str | os.PathLike) -> tuple[ModelConfig, Multimodal | None]:
    """The model config and, for a multimodal checkpoint, what wraps its language model. A
    quantization moemesh does not read is refused here, before any weight; the config keeps no
    `quantization_config` (the model is the dequantized one, and is saved so)."""
    hf = _config_json(path)
    scheme_of(hf, Path(path))
    wrapper = WRAPPERS.get(hf.get("model_type"))
    config = ModelConfig.from_hf_dict(wrapper.text_config(hf) if wrapper else hf)
    config.extra.pop("quantization_config", None)
    return config, wrapper


def read_quantization(path: str | os.PathLike) -> Scheme | None:
    """How the directory's weights are quantized (None: they are not)."""
    return scheme_of(_config_json(path), Path(path))


def _config_json(path: str | os.PathLike) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{config_file}: not valid JSON ({error})") from None


def read_state(path: str | os.PathLike, config: ModelConfig, wrapper: Multimodal | None = None) -> dict[str, Lazy]:
    """Every tensor of the directory, unread, under moemesh's (= transformers 5's) names, experts
    fused; of a multimodal checkpoint (`wrapper`), those of its language model."""
    path, fam = Path(path), family(config.model_type)
    tensors, skipped = {}, 0
    files = _weight_files(path)
    try:
        stored = SafetensorsFiles(files).tensors
    except Exception as error:  # safetensors raises its own types for truncated or corrupt files
        raise CheckpointError(f"{path}: cannot read safetensors file ({error})") from None
    scheme = read_quantization(path)
    if scheme is not None:
        stored = dequantized(stored, scheme, path)
    for key, tensor in stored.items():
        try:
            name = key if wrapper is None else wrapper.text_name(key)
        except CheckpointError as error:  # a weight that belongs nowhere
            raise CheckpointError(f"{tensor.file}: {error}") from None
        if name is None:
            skipped += 1
            continue
        tensors[_rename_moe_prefix(name, fam)] = tensor
    if skipped:
        _log.warning(
            f"{path}: loading the language model of a {wrapper.architecture} checkpoint; skipped {skipped} "
            f"tensors of its parts moemesh does not model ({', '.join(wrapper.skipped_prefixes)})"
        )
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


def _fuse_experts(tensors: dict[str, Lazy], fam: Family, config: ModelConfig) -> dict[str, Lazy]:
    per_expert: dict[str, dict[tuple[str, int], Lazy]] = defaultdict(dict)
    fused = {}
    for key, tensor in tensors.items():
        match = _PER_EXPERT.match(key)
        if match and match.group(3) in fam.hub_expert_names:
            per_expert[match.group(1)][(match.group(3), int(match.group(2)))] = tensor
        else:
            fused[key] = tensor
    gate_name, up_name, down_name = fam.hub_expert_names
    for prefix, pieces in per_expert.items():

        def piece(name: str, j: int) -> Lazy:
            if (name, j) not in pieces:
                raise CheckpointError(f"missing weight {prefix}.{j}.{name}.weight")
            return pieces[(name, j)]

        experts = range(config.num_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([piece(gate_name, j), piece(up_name, j)]) for j in experts]
        )
        fused[f"{prefix}.down_proj"] = torch.stack([piece(down_name, j) for j in experts])
        extra = sorted(j for _, j in pieces if j >= config.num_experts)
        if extra:
            raise CheckpointError(f"unexpected weight {prefix}.{extra[0]}.* (config has {config.num_experts} experts)")
    return fused


def hub_tensors(name: str, tensor: torch.Tensor, config: ModelConfig) -> dict[str, torch.Tensor]:
    """One moemesh tensor under the original per-expert Hub names (a bank becomes one tensor per
    expert and projection)."""
    fam = family(config.model_type)
    if fam.state_to_hf is not None:
        return fam.state_to_hf({name: tensor}, config)
    gate_name, up_name, down_name = fam.hub_expert_names
    in_moe_block = ".mlp.experts." in name or ".mlp.gate." in name
    hub_name = name.replace(".mlp.", f".{fam.hub_moe_prefix}.") if in_moe_block else name
    out = {}
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
    return out


def save_pretrained(
    model: MoECausalLM,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    quantize: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write a whole model as config.json and safetensors shards that transformers loads (with
    `quantize`, in that published layout, the other tensors in `dtype`: `write_pretrained`)."""
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    write_pretrained(state.items(), model.config, path, max_shard_bytes, quantize=quantize, dtype=dtype)


def _readable_by_all(file: Path) -> None:
    """The mode an ordinary new file gets (0666 less the umask): safetensors writes 0600, which
    leaves a model that other users or a serving container cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    file.chmod(0o666 & ~umask)


def write_pretrained(
    tensors: Iterable[tuple[str, torch.Tensor]],
    config: ModelConfig,
    path: str | os.PathLike,
    max_shard_bytes: int = 5 * 2**30,
    quantize: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Write moemesh tensors, given one at a time, as a Hugging Face directory: each shard of at
    most `max_shard_bytes` is written once full, so memory holds one shard. Every file is written
    under a temporary name and renamed when complete; config.json comes last. `quantize` ("fp8",
    "mxfp4"): in that published layout, the tensors it quantizes quantized from the precision they
    are given in. The others (all of them without `quantize`) in `dtype`, default as given."""
    writer = QuantizedWriter(quantize, config, dtype) if quantize else None  # refuses before writing
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []  # the hub names in each written shard
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0
    written_dtype = None

    def flush() -> None:
        save_file(pending, str(path / f".shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shards.append(list(pending))
        pending.clear()

    for name, tensor in tensors:
        for hub_name, hub_piece in hub_tensors(name, tensor, config).items():
            if writer is not None:
                stored = writer.tensors(hub_name, hub_piece.detach().cpu())
            else:
                stored = {hub_name: hub_piece if dtype is None else hub_piece.to(dtype)}
            for stored_name, piece in stored.items():
                if piece.dtype in DTYPES.values():  # the dtype of the unquantized tensors
                    written_dtype = written_dtype or piece.dtype
                size = piece.numel() * piece.element_size()
                if pending and pending_bytes + size > max_shard_bytes:
                    flush()
                    pending_bytes = 0
                pending[stored_name] = piece.detach().cpu().contiguous()
                pending_bytes += size
                total += size
    flush()
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for i, name in enumerate(names):
        os.replace(path / f".shard-{i:05d}.safetensors", path / name)
        _readable_by_all(path / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {key: name for name, keys in zip(names, shards) for key in keys},
        }
        _atomic_write(path / INDEX_FILE, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2)))
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = str(written_dtype).removeprefix("torch.")
    if writer is not None:
        hf_config["quantization_config"] = writer.config_block()
    _atomic_write(path / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf_config, indent=2) + "\n"))


def _atomic_write(target: Path, write) -> None:
    tmp = target.with_name(target.name + ".tmp")
    write(str(tmp))
    os.replace(tmp, target)
