"""Qwen3-MoE (Qwen3-30B-A3B style): softmax router with optional top-k renormalisation, RMSNorm on
each query/key head, dense layers mixed in by `decoder_sparse_step` / `mlp_only_layers`."""

from moemesh.models.config import ModelConfig
from moemesh.models.family import Family, register


def _read(hf: dict) -> None:
    # transformers ignores sliding_window unless use_sliding_window is true.
    if not hf.pop("use_sliding_window", False):
        hf["sliding_window"] = None


def _write(hf: dict, config: ModelConfig) -> None:
    hf["use_sliding_window"] = hf["sliding_window"] is not None


def _tp_plan(config: ModelConfig) -> dict[str, str]:
    layers = range(config.num_hidden_layers)
    plan = {
        "model.embed_tokens": "vocab",
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "lm_head": "vocab",
    }
    if config.qk_norm:  # one norm shared by all heads, applied here to this rank's heads
        plan["model.layers.*.self_attn.q_norm"] = "replicated_with_grad_allreduce"
        plan["model.layers.*.self_attn.k_norm"] = "replicated_with_grad_allreduce"
    if any(config.is_moe_layer(i) for i in layers):
        plan["model.layers.*.mlp.gate"] = "replicated"
        plan["model.layers.*.mlp.experts.gate_up_proj"] = "packed_colwise"
        plan["model.layers.*.mlp.experts.down_proj"] = "rowwise"
    if not all(config.is_moe_layer(i) for i in layers):
        plan["model.layers.*.mlp.gate_proj"] = "colwise"
        plan["model.layers.*.mlp.up_proj"] = "colwise"
        plan["model.layers.*.mlp.down_proj"] = "rowwise"
    return plan


FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    renames={"num_local_experts": "num_experts"},
    fixed={"qk_norm": True},
    read_hook=_read,
    write_hook=_write,
    tp_plan=_tp_plan,
)
register(FAMILY)
