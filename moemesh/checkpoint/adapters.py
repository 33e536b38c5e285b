"""LoRA adapters on disk: in a LoRA run's checkpoints, and in PEFT's format.

A LoRA run's checkpoint (`checkpoint/dcp.py`) holds what trains — the adapters (and a router the
targets name), their AdamW state — and the buffers, not the frozen base; beside them `lora.json`
records the [lora] settings, the adapted names and where the base came from (`train.init_from`,
else the seed it was drawn from).

PEFT's format (peft >= 0.17 on transformers 5), a directory of:
    adapter_config.json        peft_type LORA, r, lora_alpha, target_modules (the adapted
                               projections, by full module name), target_parameters (the expert
                               banks, `model.layers.N.mlp.experts.gate_up_proj` ...)
    adapter_model.safetensors  base_model.model.<module>.lora_A.weight [r, in] and .lora_B.weight
                               [out, r]; an expert bank's, PEFT's ParamWrapper layout: lora_A
                               [E·r, in] (expert-major rows), lora_B [out, r·E] (column j·E + e is
                               expert e's j-th), under `...mlp.experts.` + "base_layer." once per
                               bank of the module targeted after it (wrappers nest in the order
                               the module registers its tensors: gate_up_proj inside down_proj)
moemesh's factors per expert are A [E, r, in] and B [E, out, r] (`models/lora.py`). Reading takes
PEFT's per-target ranks and alphas (rank_pattern, alpha_pattern, as PEFT matches them) and rsLoRA's
scaling. Names are transformers 5's, which are moemesh's for Qwen3-MoE, Mixtral and DeepSeek.

Limits: PEFT on transformers 5 reads `target_modules` ending in gate_proj, up_proj or down_proj of
a Qwen3-MoE, Mixtral or DeepSeek model as the experts of transformers 4, so adapters on dense MLP
layers or shared experts of those families are not written in PEFT's format (merge them instead);
nor are routers trained in full, or families whose tensors transformers lays out differently
(GPT-OSS, Gemma 4). PEFT's DoRA, LoRA biases, fan_in_fan_out and modules_to_save are not read.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch import nn

from moemesh.checkpoint.dcp import CHECKPOINTS, _load, resolve_checkpoint
from moemesh.checkpoint.load import newest_directory
from moemesh.errors import CheckpointError
from moemesh.models.config import ModelConfig
from moemesh.models.lora import add_adapters, add_expert_adapters, is_adapter
from moemesh.models.moe import EXPERT_BANKS
from moemesh.parallel.pieces import local_view
from moemesh.parallel.stored import HALVES, packed_dim, stored_state

LORA_FILE = "lora.json"
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# Families whose expert banks and module names transformers 5 spells as moemesh does.
PEFT_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
# transformers 5 families for which PEFT renames these target_modules to expert banks (see above).
_PEFT_EXPERT_RENAMES = ("gate_proj", "up_proj", "down_proj", "gate")


@dataclass
class Adapter:
    """An adapter read whole (it is small): for each adapted name — a projection's module name, or
    an expert bank's `...mlp.experts.gate_up_proj` — its (rank, alpha); its tensors under moemesh's
    parameter names (routers trained in full among them); where its base came from, if known; the
    directory it was read from."""

    targets: dict[str, tuple[int, float]]
    tensors: dict[str, torch.Tensor]
    dropout: float = 0.0
    base: str | None = None
    seed: int | None = None
    routers: list[str] = field(default_factory=list)
    path: Path | None = None

    def attach(self, model: nn.Module, dtype: torch.dtype | None = torch.float32) -> dict:
        """Add this adapter's (still empty) factors to `model`, built and not yet laid out, and let
        its routers train (`load_into` then fills them, whatever the layout). Returns what is
        adapted, as `apply_lora` does."""
        modules = {name for name, _ in model.named_modules()}
        for name in [*self.targets, *self.routers]:
            if (name.rpartition(".")[0] if _bank(name) else name) not in modules:
                raise CheckpointError(f"{_another_base(self.path, self.base)}: this model has no {name}")
        linears = [name for name in self.targets if _bank(name) is None] + self.routers
        banks = [name for name in self.targets if _bank(name) is not None]
        expert_blocks = {name.rsplit(".experts.", 1)[0] for name in banks}
        add_adapters(model, [_exact(name) for name in linears], False, self.targets.get, self.dropout, dtype)
        for block in expert_blocks:
            experts = model.get_submodule(f"{block}.experts")
            names = {bank: f"{block}.experts.{bank}" for bank in EXPERT_BANKS}
            ranks = {bank: self.targets[name] for bank, name in names.items() if name in self.targets}
            add_expert_adapters(experts, ranks, self.dropout, dtype)
        return {**self.targets, **dict.fromkeys(self.routers)}

    @torch.no_grad()
    def load_into(self, model: nn.Module) -> None:
        """Copy this adapter's tensors into `model` (its factors attached, laid out, allocated):
        each rank its own piece of each."""
        params = dict(model.named_parameters())
        for name, tensor in self.tensors.items():
            if name not in params:
                raise CheckpointError(f"adapter tensor {name!r} has no place in the model")
            local, shape, index = local_view(params[name])
            if tuple(shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{_another_base(self.path, self.base)}: its {name} has shape {tuple(tensor.shape)}, "
                    f"this model's {tuple(shape)}"
                )
            piece = tensor if index is None else tensor[torch.meshgrid(*index, indexing="ij")]
            local.copy_(piece)


def _exact(name: str) -> str:
    """A target pattern that matches `name` alone (models/lora.py's patterns: fnmatch)."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _bank(name: str) -> str | None:
    leaf = name.rpartition(".")[2]
    return leaf if leaf in EXPERT_BANKS and ".experts." in name else None


def lora_record(config, adapted: dict[str, tuple[int, float] | None]) -> bytes:
    """lora.json of a LoRA run (`config`: its RunConfig; `adapted`: what `apply_lora` returned)."""
    lora, train = config.lora, config.train
    record = {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "targets": lora.targets,
        "experts": lora.experts,
        "init_from": lora.init_from,
        "adapted": adapted,  # name -> [rank, alpha], or null for a router trained in full
        "base": str(Path(train.init_from).resolve()) if train.init_from else None,
        "seed": train.seed,
    }
    return (json.dumps(record, indent=2) + "\n").encode()


def is_lora_checkpoint(path: str | os.PathLike) -> bool:
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        path = newest_directory(path)
    return (path / LORA_FILE).is_file()


def read_adapter(path: str | os.PathLike, config: ModelConfig) -> Adapter:
    """The adapter of a PEFT directory, or of a LoRA run's checkpoint or run directory (its newest
    that verifies), for a model of `config`."""
    path = Path(path)
    if (path / PEFT_CONFIG).is_file():
        return read_peft(path, config)
    if not path.is_dir():
        raise CheckpointError(f"adapter not found: {path}")
    checkpoint = resolve_checkpoint(path)
    if not (checkpoint / LORA_FILE).is_file():
        raise CheckpointError(
            f"{path} is neither a PEFT adapter directory ({PEFT_CONFIG}) nor a LoRA run's checkpoint ({LORA_FILE})"
        )
    record = json.loads((checkpoint / LORA_FILE).read_text())
    saved = json.loads((checkpoint / "config.json").read_text())
    if ModelConfig.from_hf_dict(saved) != config:
        raise CheckpointError(f"{checkpoint} adapts a different model than the one it is applied to")
    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    names = {}
    for key, item in stored.items():
        if not key.startswith("model."):
            continue
        name = key.removeprefix("model.")
        base, _, half = name.rpartition(".")
        if half in HALVES and packed_dim(base) is not None:  # stored as two halves: the whole is twice one
            shape = list(item.size)
            shape[packed_dim(base)] *= 2
            names[base] = (shape, item.properties.dtype)
        elif hasattr(item, "size"):
            names[name] = (list(item.size), item.properties.dtype)
    tensors = {}
    for name, (shape, dtype) in names.items():
        if not (is_adapter(name) or any(name.startswith(r + ".") for r in _routers(record))):
            continue  # buffers
        tensor = torch.empty(shape, dtype=dtype)
        _load(checkpoint, stored_state({"model": {name: tensor}}))  # halves are views of it: read in place
        tensors[name] = tensor
    targets = {name: tuple(plan) for name, plan in record["adapted"].items() if plan is not None}
    return Adapter(targets, tensors, record["dropout"], record["base"], record["seed"], _routers(record), path)


def _routers(record: dict) -> list[str]:
    return [name for name, plan in record["adapted"].items() if plan is None]


# ---- PEFT --------------------------------------------------------------------------------------


def read_adapter_base(path: Path) -> str | None:
    """The base model a PEFT adapter names (base_model_name_or_path), if it is a local directory."""
    named = json.loads((path / PEFT_CONFIG).read_text()).get("base_model_name_or_path")
    return named if named and Path(named).is_dir() else None


def read_peft(path: Path, config: ModelConfig) -> Adapter:
    """A PEFT LoRA directory -> Adapter (see the module docstring)."""
    try:
        peft = json.loads((path / PEFT_CONFIG).read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path / PEFT_CONFIG}: not valid JSON ({e})") from None
    if peft.get("peft_type") != "LORA":
        raise CheckpointError(f"{path / PEFT_CONFIG}: peft_type {peft.get('peft_type')!r}, moemesh reads LORA adapters")
    for key, off in (("use_dora", False), ("fan_in_fan_out", False), ("lora_bias", False), ("modules_to_save", None)):
        if peft.get(key, off) not in (off, [], {}):
            raise CheckpointError(f"{path / PEFT_CONFIG}: {key} = {peft[key]!r} is not supported by moemesh")
    if peft.get("bias", "none") != "none":
        raise CheckpointError(f"{path / PEFT_CONFIG}: bias = {peft['bias']!r} is not supported by moemesh")
    weights = path / PEFT_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"{path}: no {PEFT_WEIGHTS}")
    stored = load_file(str(weights))
    r, alpha = peft.get("r", 8), peft.get("lora_alpha", 8)
    rank_pattern, alpha_pattern = peft.get("rank_pattern") or {}, peft.get("alpha_pattern") or {}

    def alpha_of(key: str, rank: int) -> float:
        value = alpha_pattern.get(_pattern_key(alpha_pattern, key), alpha)
        return value * math.sqrt(rank) if peft.get("use_rslora") else value  # rsLoRA: alpha / sqrt(r)

    banks_of = _peft_banks(peft.get("target_parameters") or [])
    targets, tensors = {}, {}
    for key, tensor in stored.items():
        if not key.startswith(_PEFT_PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise CheckpointError(f"{weights}: unexpected tensor {key!r}")
        module, factor = key.removeprefix(_PEFT_PREFIX).removesuffix(".weight").rsplit(".", 1)
        owner, depth = module, 0
        while owner.endswith(".base_layer"):
            owner, depth = owner.removesuffix(".base_layer"), depth + 1
        if owner.endswith(".experts"):  # a bank: which one, by how deep its wrapper nests
            if config.model_type not in PEFT_FAMILIES:
                raise CheckpointError(
                    f"{weights}: expert adapters of a {config.model_type} model are not read (transformers lays "
                    f"out its expert tensors differently from moemesh); supported: {', '.join(PEFT_FAMILIES)}"
                )
            banks = banks_of(owner)
            if not banks or depth >= len(banks):
                raise CheckpointError(f"{weights}: {key!r} matches no target_parameters entry")
            bank = banks[len(banks) - 1 - depth]
            name = f"{owner}.{bank}"
            # A bank's factors hold every expert's: its rank is adapter_config.json's, and the
            # number of experts must then be this model's.
            num_experts, rank = config.num_experts, rank_pattern.get(_pattern_key(rank_pattern, name), r)
            rows = tensor.shape[0 if factor == "lora_A" else 1]
            if rows != num_experts * rank:
                raise CheckpointError(
                    f"{_another_base(path, peft.get('base_model_name_or_path'))}: its {name} adapters are "
                    f"of {rows / rank:g} experts at rank {rank} (adapter_config.json's); this model has "
                    f"{num_experts} experts a layer"
                )
            if factor == "lora_A":  # [E·r, in] -> [E, r, in]
                tensors[f"{name}_lora_A"] = tensor.reshape(num_experts, rank, tensor.shape[-1]).clone()
                targets[name] = (rank, alpha_of(name, rank))
            else:  # [out, r·E] -> [E, out, r]
                tensors[f"{name}_lora_B"] = tensor.reshape(tensor.shape[0], rank, num_experts).permute(2, 0, 1).clone()
        else:
            tensors[f"{owner}.{factor}"] = tensor.clone()
            if factor == "lora_A":
                rank = tensor.shape[0]
                targets[owner] = (rank, alpha_of(owner, rank))
    for name, (rank, _) in targets.items():
        expected = rank_pattern.get(_pattern_key(rank_pattern, name), r)
        if expected != rank:
            raise CheckpointError(f"{path}: {name} has rank {rank}, its adapter_config.json says {expected}")
    return Adapter(targets, tensors, 0.0, peft.get("base_model_name_or_path"), path=path)


def _another_base(path: Path | None, base: str | None) -> str:
    """How a message about an adapter that does not fit the model it is applied to starts."""
    return f"{path or 'the adapter'} was made for another base model{f' ({base})' if base else ''}"


def _pattern_key(patterns: dict, key: str) -> str:
    """PEFT's get_pattern_key: the first pattern that matches the end of `key` after a dot."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", key)), key)


def _peft_banks(target_parameters: list[str]):
    """experts module name -> the banks target_parameters names on it, in registration order."""

    def banks(owner: str) -> list[str]:
        return [
            bank
            for bank in EXPERT_BANKS
            if any(f"{owner}.{bank}" == t or f"{owner}.{bank}".endswith("." + t) for t in target_parameters)
        ]

    return banks


def write_peft(adapter: Adapter, config: ModelConfig, target: str | os.PathLike) -> None:
    """Adapter -> a PEFT LoRA directory that transformers + PEFT load (`PeftModel.from_pretrained`)."""
    if config.model_type not in PEFT_FAMILIES:
        raise CheckpointError(
            f"PEFT's format for a {config.model_type} adapter is not written (transformers lays out its "
            f"tensors differently); supported: {', '.join(PEFT_FAMILIES)}. Use `moemesh convert --merge`"
        )
    if adapter.routers:
        raise CheckpointError(
            f"the adapter trains routers in full ({adapter.routers[0]}, ...), which moemesh does not write in "
            "PEFT's format; use `moemesh convert --merge`"
        )
    linears = sorted(name for name in adapter.targets if _bank(name) is None)
    renamed = [name for name in linears if name.rpartition(".")[2] in _PEFT_EXPERT_RENAMES]
    if renamed:
        raise CheckpointError(
            f"PEFT on transformers 5 reads target_modules ending in {renamed[0].rpartition('.')[2]} of a "
            f"{config.model_type} model as expert layers, so the adapter on {renamed[0]} cannot be written in "
            "PEFT's format; use `moemesh convert --merge`, or train without that target"
        )
    banks = sorted(name for name in adapter.targets if _bank(name) is not None)
    ranks = {rank for rank, _ in adapter.targets.values()}
    alphas = {alpha for _, alpha in adapter.targets.values()}
    r, alpha = max(ranks), max(alphas)
    rank_pattern = {re.escape(n): rank for n, (rank, _) in adapter.targets.items() if rank != r}
    alpha_pattern = {re.escape(n): a for n, (_, a) in adapter.targets.items() if a != alpha}
    tensors = {}
    for name in linears:
        for factor in ("lora_A", "lora_B"):
            tensors[f"{_PEFT_PREFIX}{name}.{factor}.weight"] = adapter.tensors[f"{name}.{factor}"]
    by_owner: dict[str, list[str]] = {}
    for name in banks:
        owner, _, bank = name.rpartition(".")
        by_owner.setdefault(owner, []).append(bank)
    for owner, owned in by_owner.items():
        owned = [bank for bank in EXPERT_BANKS if bank in owned]
        for position, bank in enumerate(owned):
            module = owner + ".base_layer" * (len(owned) - 1 - position)
            a, b = adapter.tensors[f"{owner}.{bank}_lora_A"], adapter.tensors[f"{owner}.{bank}_lora_B"]
            tensors[f"{_PEFT_PREFIX}{module}.lora_A.weight"] = a.reshape(-1, a.shape[-1])  # [E·r, in]
            tensors[f"{_PEFT_PREFIX}{module}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], -1)  # [out, r·E]
    peft = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": adapter.base,
        "r": r,
        "lora_alpha": alpha,
        # PEFT refuses dropout on target_parameters; it plays no part in inference.
        "lora_dropout": adapter.dropout if not banks else 0.0,
        "target_modules": linears,
        "target_parameters": banks,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(target / PEFT_WEIGHTS))
    (target / PEFT_CONFIG).write_text(json.dumps(peft, indent=2) + "\n")
