"""The model configuration, in Hugging Face `config.json` field names.

One dataclass covers every family; a family module translates its own `config.json` quirks
(field aliases, fixed behaviours) in and out. Fields we do not use are kept in `extra` so that a
load -> save round trip writes them back unchanged.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from moemesh.errors import ConfigError


@dataclass
class ModelConfig:
    model_type: str = "qwen3_moe"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP layers
    moe_intermediate_size: int = 32  # each expert
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    attention_bias: bool = False
    qk_norm: bool = True  # RMSNorm on each query/key head (Qwen3), not an HF field
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        from moemesh.models.registry import family

        # Whatever the family hard-wires (Mixtral: no q/k norm, renormalised top-k) wins.
        for name, value in family(self.model_type).fixed.items():
            setattr(self, name, copy.deepcopy(value))
        self.validate()

    # ---- derived ----------------------------------------------------------------------------
    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Qwen3-MoE's rule: sparse unless listed in mlp_only_layers or off the sparse step."""
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    # ---- checks -----------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, message: str):
            if not ok:
                raise ConfigError(f"model config: {message}")

        positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "num_experts_per_tok", "decoder_sparse_step"]
        for name in positive:
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive integer, got {value!r}")
        need(self.num_experts >= 0, f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            need(self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok ({self.num_experts_per_tok}) must be <= num_experts ({self.num_experts})")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be positive")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
             f"num_key_value_heads ({self.num_key_value_heads})")
        need(self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
             f"({self.num_attention_heads}) when head_dim is not given")
        need(self.attention_head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.attention_head_dim}")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        need(not bad_layers, f"mlp_only_layers has indices outside 0..{self.num_hidden_layers - 1}: {bad_layers}")
        if any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            need(self.intermediate_size > 0, "intermediate_size must be positive when dense layers exist")

    # ---- HF translation ---------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a `config.json` dict; its `model_type` picks the family."""
        from moemesh.models.registry import family

        return family(hf.get("model_type")).config_from_hf(dict(hf))

    def to_hf_dict(self) -> dict[str, Any]:
        from moemesh.models.registry import family

        return family(self.model_type).config_to_hf(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)
