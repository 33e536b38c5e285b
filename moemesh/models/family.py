"""What differs between model families: how their `config.json` and their original (per-expert)
checkpoint keys are spelled. The network itself is `transformer.MoECausalLM` for all of them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moemesh.models.config import ModelConfig

# config.json keys that describe the file rather than the model.
_BOOKKEEPING = {"architectures", "transformers_version", "model_type", "_name_or_path"}


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str  # transformers class name written to config.json
    renames: dict[str, str] = field(default_factory=dict)  # config.json name -> ModelConfig field
    write_renames: dict[str, str] = field(default_factory=dict)  # ModelConfig field -> config.json name
    fixed: dict[str, Any] = field(default_factory=dict)  # behaviour the family hard-wires
    not_in_hf: tuple[str, ...] = ()  # ModelConfig fields this family's config.json lacks
    hf_fields: tuple[str, ...] = ()  # the family-specific fields (ModelConfig.family_fields) it has
    hub_moe_prefix: str = "mlp"  # per-expert checkpoints: `layers.N.<prefix>.experts.J...`
    hub_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    read_hook: Callable[[dict], None] = lambda hf: None  # in-place fix-ups of a config.json dict
    write_hook: Callable[[dict, ModelConfig], None] = lambda hf, config: None
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

    def config_from_hf(self, hf: dict[str, Any]) -> ModelConfig:
        hf = dict(hf)
        self.read_hook(hf)
        for theirs, ours in self.renames.items():
            if theirs in hf:
                hf[ours] = hf.pop(theirs)
        _read_rope(hf)
        known = set(ModelConfig.field_names())
        values = {k: hf.pop(k) for k in list(hf) if k in known and k != "model_type"}
        extra = {k: v for k, v in hf.items() if k not in _BOOKKEEPING}
        return ModelConfig(model_type=self.model_type, extra=extra, **values)

    def config_to_hf(self, config: ModelConfig) -> dict[str, Any]:
        out = {"architectures": [self.architecture], "model_type": self.model_type}
        skip = set(self.fixed) | set(self.not_in_hf) | {"model_type", "qk_norm", "rope_theta", "rope_scaling"}
        unused = set(ModelConfig.family_fields()) - set(self.hf_fields)
        for name in ModelConfig.field_names():
            if name not in skip | unused:
                out[self.write_renames.get(name, name)] = getattr(config, name)
        out["head_dim"] = config.attention_head_dim  # some families cannot read null
        # Both spellings: transformers 5 reads rope_parameters, transformers 4 rope_theta.
        out["rope_theta"] = config.rope_theta
        out["rope_parameters"] = {**(config.rope_scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}
        out.update(config.extra)
        self.write_hook(out, config)
        return out


def _read_rope(hf: dict[str, Any]) -> None:
    """rope_parameters (transformers 5) or rope_scaling (4) -> rope_theta and, unless plain, rope_scaling
    (ModelConfig.validate rejects the types moemesh lacks)."""
    rope = dict(hf.pop("rope_parameters", None) or hf.pop("rope_scaling", None) or {})
    hf.pop("rope_scaling", None)
    rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")  # "type": the old spelling
    if "rope_theta" in rope:
        hf["rope_theta"] = rope.pop("rope_theta")
    if rope["rope_type"] == "yarn":
        # As transformers' standardize_rope_params: a top-level original_max_position_embeddings
        # wins, else the pretraining length defaults to max_position_embeddings.
        if "original_max_position_embeddings" in hf:
            rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        rope.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", ModelConfig.max_position_embeddings)
        )
    if rope["rope_type"] != "default":
        hf["rope_scaling"] = rope
