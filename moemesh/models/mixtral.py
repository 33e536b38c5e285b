"""Mixtral: every layer sparse, top-k on the router logits then softmax over the k (the same
function as softmax -> top-k -> renormalise), no query/key norm, per-expert weights w1/w3/w2 in the
original checkpoints."""

from moemesh.errors import ConfigError
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family, register


def _read(hf: dict) -> None:
    if hf.get("router_jitter_noise", 0.0):
        raise ConfigError("model config: router_jitter_noise > 0 is not supported")
    # Mixtral's intermediate_size is the width of each expert; it has no dense layers.
    if "intermediate_size" in hf:
        hf["moe_intermediate_size"] = hf["intermediate_size"]


def _write(hf: dict, config: ModelConfig) -> None:
    hf["intermediate_size"] = config.moe_intermediate_size


def _tp_plan(config: ModelConfig) -> dict[str, str]:
    return {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate": "replicated",
        "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "model.layers.*.mlp.experts.down_proj": "rowwise",
        "lm_head": "vocab",
    }


FAMILY = Family(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    renames={"num_local_experts": "num_experts"},
    write_renames={"num_experts": "num_local_experts"},
    fixed={
        "qk_norm": False,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_bias": False,
    },
    not_in_hf=("moe_intermediate_size",),
    hub_moe_prefix="block_sparse_moe",
    hub_expert_names=("w1", "w3", "w2"),
    read_hook=_read,
    write_hook=_write,
    tp_plan=_tp_plan,
)
register(FAMILY)
