"""What differs between model families: how their `config.json` is spelled (`ConfigSpelling`, in
config.py), how their original (per-expert) checkpoint keys are, and the network parts some of them
replace. The network itself is `transformer.MoECausalLM` for all of them. Each family's module makes
its `Family` and registers it (`register`) as it is imported; `registry.py` imports them all."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moemesh.models.config import ConfigSpelling, ModelConfig, register, spelling


@dataclass(frozen=True)
class Family(ConfigSpelling):
    hub_moe_prefix: str = "mlp"  # per-expert checkpoints: `layers.N.<prefix>.experts.J...`
    hub_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # Tensor-parallel plan of a model with this config: parameter or module path pattern (`*`
    # stands for one path component) -> style; see moemesh/parallel/tensor.py.
    tp_plan: Callable[[ModelConfig], dict[str, str]] = lambda config: {}
    # Checkpoint tensors whose names or layouts differ from moemesh's (GPT-OSS: transposed,
    # interleaved experts): state dict in transformers' layout -> moemesh's, and back. None: the
    # default (per-expert hub names, fused by checkpoint/hf.py).
    state_from_hf: Callable[[dict, ModelConfig], dict] | None = None
    state_to_hf: Callable[[dict, ModelConfig], dict] | None = None
    # Network parts that differ (Gemma 4): (config, layer index) -> decoder layer, and config ->
    # rotary tables (positions, dtype -> what the layers' attention reads). None: transformer.py's.
    decoder_layer: Callable[[ModelConfig, int], Any] | None = None
    rotary: Callable[[ModelConfig], Any] | None = None


def family(model_type: str | None) -> Family:
    """The family of `model_type`; ConfigError naming the known ones."""
    found = spelling(model_type)
    if not isinstance(found, Family):
        raise TypeError(f"model_type {model_type!r} is registered without a Family")
    return found


__all__ = ["Family", "family", "register"]
