"""The model configuration, in Hugging Face `config.json` field names.

One dataclass covers every family; a family module translates its own `config.json` quirks
(field aliases, fixed behaviours) in and out through its `ConfigSpelling`, which it registers here
when it is imported (`models/registry.py` imports them all): so this file names no family, and a
family's module may import it. Fields we do not use are kept in `extra` so that a load -> save round
trip writes them back unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from moemesh.errors import ConfigError
from moemesh.models.rope import KEYS


@dataclass
class ModelConfig:
    model_type: str = "qwen3_moe"  # the family: qwen3_moe, mixtral, gpt_oss, deepseek_v2, deepseek_v3, gemma4_text
    vocab_size: int = 256  # embedding and head rows; must cover the tokenizer
    hidden_size: int = 64  # the residual stream's width
    intermediate_size: int = 128  # dense MLP layers
    moe_intermediate_size: int = 32  # each expert
    num_hidden_layers: int = 2  # decoder layers
    num_attention_heads: int = 4  # query heads
    num_key_value_heads: int = 2  # key/value heads (grouped-query attention when fewer than the query heads)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 8  # routed experts of an MoE layer; 0: every layer dense
    num_experts_per_tok: int = 2  # experts each token is routed to (top-k)
    norm_topk_prob: bool = False  # renormalise the chosen experts' weights to sum to 1
    decoder_sparse_step: int = 1  # every n-th layer is MoE (Qwen3-MoE's rule)
    mlp_only_layers: list[int] = field(default_factory=list)  # indices of layers that are dense instead of MoE
    hidden_act: str = "silu"  # the MLPs' activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU, Gemma 4)
    rms_norm_eps: float = 1e-6  # RMSNorm's epsilon
    rope_theta: float = 10000.0  # RoPE's base
    # The rest of config.json's rope_parameters, for scaled RoPE (rope.py: rope_type "yarn" or
    # "proportional", factor, ...); None: plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768  # the longest sequence (train.seq_len and a served context at most this)
    sliding_window: int | None = None  # local attention window (on the layers layer_types marks); none: full attention
    attention_bias: bool = False  # biases on the q/k/v/o projections
    qk_norm: bool = True  # RMSNorm on each query/key head (Qwen3), not an HF field
    tie_word_embeddings: bool = False  # the head shares the embedding's weights
    initializer_range: float = 0.02  # std of the normal initialisation of a model drawn from the seed
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in the training loss
    output_router_logits: bool = False  # train (and log) the load-balancing loss
    bos_token_id: int | None = None  # config.json's beginning-of-text token (kept for a round trip)
    eos_token_id: int | list[int] | None = None  # end-of-text token(s): generation stops there
    pad_token_id: int | None = None  # config.json's padding token (kept for a round trip)
    # ---- family-specific (written to config.json only by the families that use them) ----------
    layer_types: list[str] | None = None  # per layer "sliding_attention" | "full_attention" (GPT-OSS)
    attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (GPT-OSS)
    router_bias: bool = False  # a bias on the router logits (GPT-OSS)
    expert_bias: bool = False  # biases on every expert's gate_up and down projections (GPT-OSS)
    swiglu_alpha: float | None = None  # clamped SwiGLU (GPT-OSS): gate * sigmoid(alpha * gate) * (up + 1)
    swiglu_limit: float | None = None  # ... with gate <= limit and |up| <= limit
    # Multi-head latent attention (DeepSeek V2/V3): on when kv_lora_rank is set.
    q_lora_rank: int | None = None  # None: a full-rank q_proj (V2-Lite)
    kv_lora_rank: int | None = None  # rank of the compressed key/value latent (the cached part)
    qk_nope_head_dim: int | None = None  # per head: query/key dims without RoPE
    qk_rope_head_dim: int | None = None  # per head: query/key dims with RoPE (one rope key shared by the heads)
    v_head_dim: int | None = None  # per head: value dims
    rope_interleave: bool = False  # the rope dims come in (even, odd) pairs
    n_shared_experts: int = 0  # a dense SwiGLU of n × moe_intermediate_size beside the routed experts
    first_k_dense_replace: int = 0  # the first k layers are dense
    scoring_func: str = "softmax"  # router scores: "softmax" or "sigmoid" (V3, chosen with a bias)
    # DeepSeek's router (moe.GroupLimitedRouter): "greedy" | "group_limited_greedy" (V2) | "noaux_tc"
    # (V3: groups limited, bias-corrected choice); None: the softmax top-k router (moe.Router).
    topk_method: str | None = None
    n_group: int | None = None  # experts are chosen from the best topk_group of n_group groups
    topk_group: int | None = None  # ... the best topk_group groups
    routed_scaling_factor: float = 1.0  # the routed experts' output is scaled by this
    # Gemma 4 (text): the full_attention layers have their own head size, key/value heads (with
    # attention_k_eq_v) and rope_parameters (with rope_theta); logits are soft-capped.
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None  # the full_attention layers' key/value heads
    attention_k_eq_v: bool = False  # the full layers' values are their keys before the key norm
    full_attention_rope: dict[str, Any] | None = None  # the full_attention layers' rope_parameters
    final_logit_softcapping: float | None = None  # logits soft-capped to this bound (tanh); none: not capped
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        # Whatever the family hard-wires (Mixtral: no q/k norm, renormalised top-k) wins.
        for name, value in spelling(self.model_type).fixed.items():
            setattr(self, name, copy.deepcopy(value))
        self.validate()

    # ---- derived ----------------------------------------------------------------------------
    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates per head: all of them, or the rope part of latent attention."""
        return self.qk_rope_head_dim if self.kv_lora_rank is not None else self.attention_head_dim

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The window of this layer's attention: `sliding_window` everywhere, or only on the layers
        that `layer_types` marks as sliding."""
        if self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer_idx >= self.first_k_dense_replace
            and layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    # ---- checks -----------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, message: str):
            if not ok:
                raise ConfigError(f"model config: {message}")

        positive = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "num_experts_per_tok",
            "decoder_sparse_step",
        ]
        for name in positive:
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.num_experts >= 0, f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            need(
                self.num_experts_per_tok <= self.num_experts,
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})",
            )
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
        need(
            self.num_attention_heads % self.num_key_value_heads == 0,
            f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
            f"num_key_value_heads ({self.num_key_value_heads})",
        )
        need(
            self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
            f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
            f"({self.num_attention_heads}) when head_dim is not given",
        )
        need(self.attention_head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.attention_head_dim}")
        need(
            self.hidden_act in ("silu", "gelu_pytorch_tanh"),
            f"hidden_act {self.hidden_act!r} is not supported (only 'silu' and 'gelu_pytorch_tanh')",
        )
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad_layers, f"mlp_only_layers has indices outside 0..{self.num_hidden_layers - 1}: {bad_layers}")
        if self.layer_types is not None:
            need(
                len(self.layer_types) == self.num_hidden_layers,
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers",
            )
            bad_types = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            need(not bad_types, f"layer_types has unknown types {bad_types}")
        if self.kv_lora_rank is not None:
            dims = ["qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
            need(
                all(isinstance(getattr(self, d), int) and getattr(self, d) > 0 for d in dims),
                f"multi-head latent attention needs positive {', '.join(dims)}",
            )
            need(
                self.num_key_value_heads == self.num_attention_heads,
                "multi-head latent attention has one key/value head per query head "
                f"(num_key_value_heads {self.num_key_value_heads} != num_attention_heads {self.num_attention_heads})",
            )
        if self.rope_scaling is not None:
            self._validate_rope_scaling(need, self.rope_scaling)
        if self.full_attention_rope is not None:
            need(
                isinstance(self.full_attention_rope.get("rope_theta"), (int, float)),
                "full_attention_rope needs a rope_theta",
            )
            scaling = {k: v for k, v in self.full_attention_rope.items() if k != "rope_theta"}
            if scaling.get("rope_type", "default") != "default":
                self._validate_rope_scaling(need, scaling)
        need(self.scoring_func in ("softmax", "sigmoid"), f"scoring_func {self.scoring_func!r} is not supported")
        need(
            self.topk_method in (None, "greedy", "group_limited_greedy", "noaux_tc"),
            f"topk_method {self.topk_method!r} is not supported",
        )
        groups = self.n_group or 1
        need(self.num_experts % groups == 0, f"n_group ({groups}) must divide num_experts ({self.num_experts})")
        need(1 <= (self.topk_group or 1) <= groups, f"topk_group ({self.topk_group}) must be in 1..n_group ({groups})")
        need(
            (self.swiglu_alpha is None) == (self.swiglu_limit is None),
            "swiglu_alpha and swiglu_limit are given together or not at all",
        )
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            need(self.intermediate_size > 0, "intermediate_size must be positive when dense layers exist")

    @staticmethod
    def _validate_rope_scaling(need, scaling: dict[str, Any]) -> None:
        rope_type = scaling.get("rope_type")
        need(
            rope_type in KEYS,
            f"rope_type {rope_type!r} is not supported (only 'default', {', '.join(map(repr, KEYS))})",
        )
        unknown = sorted(set(scaling) - KEYS[rope_type])
        need(not unknown, f"{rope_type} rope parameters {unknown} are not supported")
        factor = scaling.get("factor")
        need(
            factor is None or (isinstance(factor, (int, float)) and factor >= 1),
            f"rope factor must be a number >= 1, got {factor!r}",
        )
        if rope_type == "yarn":
            original = scaling.get("original_max_position_embeddings")
            need(
                isinstance(original, int) and original > 0,
                f"yarn needs a positive original_max_position_embeddings, got {original!r}",
            )
        else:
            fraction = scaling.get("partial_rotary_factor", 1.0)
            need(
                isinstance(fraction, (int, float)) and 0 <= fraction <= 1,
                f"partial_rotary_factor must be in [0, 1], got {fraction!r}",
            )

    # ---- HF translation ---------------------------------------------------------------------
    @classmethod
    def family_fields(cls) -> list[str]:
        """The fields after `pad_token_id`: only some families have them in config.json."""
        names = cls.field_names()
        return names[names.index("pad_token_id") + 1 :]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a `config.json` dict; its `model_type` picks the family."""
        return spelling(hf.get("model_type")).config_from_hf(dict(hf))

    def to_hf_dict(self) -> dict[str, Any]:
        return spelling(self.model_type).config_to_hf(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# ---- each family's config.json, registered by the family's module -------------------------------

# config.json keys that describe the file rather than the model.
_BOOKKEEPING = {"architectures", "transformers_version", "model_type", "_name_or_path"}


@dataclass(frozen=True)
class ConfigSpelling:
    """How a family spells its `config.json` and what it hard-wires: what a ModelConfig needs to
    know of its family. `family.Family` adds how the network and the checkpoints differ."""

    model_type: str
    architecture: str  # transformers class name written to config.json
    renames: dict[str, str] = field(default_factory=dict)  # config.json name -> ModelConfig field
    write_renames: dict[str, str] = field(default_factory=dict)  # ModelConfig field -> config.json name
    fixed: dict[str, Any] = field(default_factory=dict)  # behaviour the family hard-wires
    not_in_hf: tuple[str, ...] = ()  # ModelConfig fields this family's config.json lacks
    hf_fields: tuple[str, ...] = ()  # the family-specific fields (ModelConfig.family_fields) it has
    read_hook: Callable[[dict], None] = lambda hf: None  # in-place fix-ups of a config.json dict
    write_hook: Callable[[dict, ModelConfig], None] = lambda hf, config: None

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


_SPELLINGS: dict[str, ConfigSpelling] = {}
S = TypeVar("S", bound=ConfigSpelling)


def register(spelling: S) -> S:
    """Make `spelling` (a family: `family.Family`) the one of its model_type; a family's module
    calls this as it is imported."""
    if spelling.model_type in _SPELLINGS:
        raise ValueError(f"model_type {spelling.model_type!r} is registered twice")
    _SPELLINGS[spelling.model_type] = spelling
    return spelling


def spelling(model_type: str | None) -> ConfigSpelling:
    """The registered family of `model_type`; ConfigError naming the known ones."""
    if model_type in _SPELLINGS:
        return _SPELLINGS[model_type]
    close = difflib.get_close_matches(str(model_type), _SPELLINGS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown model_type {model_type!r}{hint}; supported: {', '.join(sorted(_SPELLINGS))}")


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
