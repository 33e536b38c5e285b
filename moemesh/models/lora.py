"""LoRA (Hu et al., 2021): a frozen base model plus trainable low-rank adapters, in PEFT's
conventions — B starts at zero (the adapted model starts as the base), A from the variance of
PEFT's Kaiming-uniform init (normal, std 1/sqrt(3·in), layout-independent as every moemesh init),
the update scaled by alpha / rank, the factors named `lora_A` and `lora_B`.

What takes adapters (`apply_lora`, from the run's `[lora]` section):
  linears  each projection (`ops.linear.Linear`: attention, dense MLP, DeepSeek's shared experts)
           whose name matches a `lora.targets` pattern gains lora_A [r, in] and lora_B [out, r]:
           y = x·Wᵀ + b + s · dropout(x)·Aᵀ·Bᵀ
  experts  with `lora.experts`, every expert bank gains per-expert factors beside its fused
           tensors: gate_up_proj_lora_A [E, r, H], gate_up_proj_lora_B [E, 2I, r],
           down_proj_lora_A [E, r, I], down_proj_lora_B [E, H, r]. They run inside the bank's
           grouped GEMM path (`Experts.forward`): the rows routed to expert e times A_e, then B_e,
           as two grouped GEMMs of rank r over all experts at once (`ops/grouped_mm.py`)
  routers  a router that a target names is trained in full (its logits are small); unnamed, it
           stays frozen with the rest of the base
Everything else is frozen: no gradient, no optimizer state. The adapters keep the dtype they are
made in (train.param_dtype); the base may be bf16.

How it computes (a LoRA step is bound by the host's kernel launches, bench/train/lora.py --count-ops):
each forward casts A and s·B to the compute dtype once (`ops/low_rank.py`: the scale rides B's
cast, and a checkpointed layer's recomputation reuses the copies), and the update runs in the
base's own autograd node (`models/adapted.py`, `ops/linear.py`, `ops/grouped_mm.py`): its rank-r
GEMM adds into the base product, and in backward its share of the input gradient into the base's.
So an adapter adds to a forward two GEMMs (x·Aᵀ, then the one that adds its product with s·Bᵀ)
and one cast per factor, and no elementwise kernel; projections of one input (q, k, v) share the
first GEMM.

Patterns: `*` stands for any characters; a pattern matches a module's full name, or its end after
a dot ("q_proj" matches every layer's attention q_proj). A pattern that matches nothing LoRA can
adapt is an error.

Layouts (`moemesh/parallel`): a bank's adapters are per expert on dim 0 like the bank, so EP keeps
each with its expert; TP splits A and B to match their base (colwise base: B by rows; rowwise
base: A by columns; the other factor whole, its gradient summed over tp); FSDP shards them.

`merge_adapters` folds W + s·B·A into the base weights — whole, or a TP shard: a shard's factors
give exactly its block of the product — and removes the adapters (generation, serving, export).
`merged_state_dict` computes the same weights without touching the model (a training run handing
its current weights to an engine: `models/weights.py`).

Limit: dropout draws its masks on each rank for the rows that rank holds, so with dropout > 0 a
layout does not reproduce one process exactly (as in every framework); at 0 it does.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from moemesh.errors import ConfigError
from moemesh.models.adapted import LoraLinear, has_adapter
from moemesh.models.moe import EXPERT_BANKS, Experts, MoEBlock
from moemesh.ops.linear import Linear

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


@dataclass
class LoraConfig:
    """The run config's `[lora]` section."""

    rank: int = 0  # 0: no adapters, the whole model trains
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on an adapter's input, in training
    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))  # projections (and routers) adapted
    experts: bool = True  # adapters on every expert of every MoE layer (both banks)
    # Start from these adapters (a PEFT directory or a LoRA run), which then say what is adapted
    # at which rank and alpha (rank, alpha, targets and experts are not used).
    init_from: str = ""
    # A base read from a quantized checkpoint (block FP8, MXFP4: train.init_from) stays in its
    # published bytes on the device, dequantized per product; false: read dense, as full training.
    keep_quantized: bool = True

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or bool(self.init_from)

    def check(self) -> None:
        if self.rank < 0:
            raise ConfigError(f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        if self.enabled and self.alpha <= 0:
            raise ConfigError(f"lora.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.rank > 0 and not self.targets and not self.experts:
            raise ConfigError("lora.targets is empty and lora.experts is false: nothing to adapt")


def add_linear_adapter(module: Linear, rank: int, alpha: float, dropout: float, dtype: torch.dtype | None) -> None:
    factory = {"device": module.weight.device, "dtype": dtype or module.weight.dtype}
    module.__class__ = LoraLinear
    module.lora_A = nn.Parameter(torch.empty(rank, module.in_features, **factory))
    module.lora_B = nn.Parameter(torch.empty(module.out_features, rank, **factory))
    module.lora_scaling, module.lora_dropout = alpha / rank, dropout


def add_expert_adapters(
    experts: Experts, ranks: dict[str, tuple[int, float]], dropout: float, dtype: torch.dtype | None
) -> None:
    """Adapters on the banks named in `ranks` (bank -> (rank, alpha)), after the bank's tensors."""
    experts.lora_scaling = {}
    experts.lora_dropout = dropout
    for bank in EXPERT_BANKS:
        if bank not in ranks:
            continue
        rank, alpha = ranks[bank]
        weight = getattr(experts, bank)  # [E, out, in]
        factory = {"device": weight.device, "dtype": dtype or weight.dtype}
        num_experts, out_features, in_features = weight.shape
        setattr(experts, f"{bank}_lora_A", nn.Parameter(torch.empty(num_experts, rank, in_features, **factory)))
        setattr(experts, f"{bank}_lora_B", nn.Parameter(torch.empty(num_experts, out_features, rank, **factory)))
        experts.lora_scaling[bank] = alpha / rank


def is_adapter(name: str) -> bool:
    """Whether the parameter `name` is a LoRA factor."""
    leaf = name.rpartition(".")[2]
    return leaf in ("lora_A", "lora_B") or leaf.endswith(("_lora_A", "_lora_B"))


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def apply_lora(
    model: nn.Module, config: LoraConfig, dtype: torch.dtype | None = None
) -> dict[str, tuple[int, float] | None]:
    """Freeze `model` (built, on any device, before its layout) and add the adapters `config`
    asks for, in `dtype` (default: the base's). Returns what is adapted: each projection's module
    name and each expert bank's (`...experts.gate_up_proj`) -> (rank, alpha); each router trained
    in full -> None."""
    config.check()

    def plan(name: str) -> tuple[int, float] | None:
        return (config.rank, config.alpha)

    return add_adapters(model, config.targets, config.experts, plan, config.dropout, dtype)


def add_adapters(
    model: nn.Module,
    targets: list[str],
    experts: bool,
    plan: Callable[[str], tuple[int, float]],
    dropout: float = 0.0,
    dtype: torch.dtype | None = None,
) -> dict[str, tuple[int, float] | None]:
    """`apply_lora` with a (rank, alpha) per adapted name (`plan`): adapters read from elsewhere
    (PEFT's) may differ per target."""
    model.requires_grad_(False)
    routers = {name: module for name, module in model.named_modules() if _is_router(model, name)}
    matched = {pattern: False for pattern in targets}
    adapted = {}
    for name, module in list(model.named_modules()):
        hits = [pattern for pattern in targets if matches(name, pattern)]
        router = next((r for r in routers if name == r or name.startswith(r + ".")), None)
        if not hits or (router is not None and name != router):
            continue
        if router is not None:
            module.requires_grad_(True)  # a named router trains in full
            adapted[name] = None
        elif type(module) is Linear:
            adapted[name] = plan(name)
            add_linear_adapter(module, *adapted[name], dropout, dtype)
        else:
            continue
        matched.update(dict.fromkeys(hits, True))
    unmatched = [pattern for pattern, hit in matched.items() if not hit]
    if unmatched:
        raise ConfigError(
            f"lora.targets: {unmatched[0]!r} matches no projection or router of this "
            f"{getattr(model, 'config', None) and model.config.model_type} model"
        )
    if experts:
        banks = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEBlock)]
        if not banks:
            raise ConfigError("lora.experts = true, but this model has no MoE layer (set lora.experts = false)")
        for name, block in banks:
            ranks = {bank: plan(f"{name}.experts.{bank}") for bank in EXPERT_BANKS}
            add_expert_adapters(block.experts, ranks, dropout, dtype)
            adapted.update({f"{name}.experts.{bank}": rank for bank, rank in ranks.items()})
    return adapted


def _is_router(model: nn.Module, name: str) -> bool:
    parent, _, leaf = name.rpartition(".")
    return leaf == "gate" and isinstance(model.get_submodule(parent) if parent else model, MoEBlock)


def trainable_names(model: nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if param.requires_grad]


def _merged(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapted weights of one module, merged: weight name -> W + s·B·A (in fp32, then in
    W's dtype); empty when it has no adapter."""
    if has_adapter(module):
        delta = module.lora_B.float() @ module.lora_A.float() * module.lora_scaling
        return {"weight": (module.weight.float() + delta).to(module.weight.dtype)}
    merged = {}
    if isinstance(module, Experts):
        for bank, scaling in module.lora_scaling.items():
            weight = getattr(module, bank)
            a, b = getattr(module, f"{bank}_lora_A"), getattr(module, f"{bank}_lora_B")
            merged[bank] = (weight.float() + torch.bmm(b.float(), a.float()) * scaling).to(weight.dtype)
    return merged


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """W += s·B·A for every adapter (in fp32, then in W's dtype), and the adapters removed: the
    model computes what it computed with them, at the base's cost. Works on whole modules and on
    tensor-parallel shards alike (not on FSDP-sharded ones)."""
    for module in model.modules():
        for name, weight in _merged(module).items():
            getattr(module, name).copy_(weight)
        if has_adapter(module):
            for attribute in ("lora_A", "lora_B", "lora_scaling", "lora_dropout"):
                delattr(module, attribute)
            if type(module) is LoraLinear:
                module.__class__ = Linear
        if isinstance(module, Experts) and module.has_adapters:
            for bank in module.lora_scaling:
                delattr(module, f"{bank}_lora_A")
                delattr(module, f"{bank}_lora_B")
            module.lora_scaling = {}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as `merge_adapters` would leave it, the model left as it is: the
    adapted weights merged (new tensors), the factors left out, every other entry the model's own
    tensor (shared, not copied)."""
    state = model.state_dict()
    for prefix, module in model.named_modules():
        for name, weight in _merged(module).items():
            state[f"{prefix}.{name}" if prefix else name] = weight
    return {name: t for name, t in state.items() if not is_adapter(name)}
