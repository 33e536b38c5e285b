"""DeepSeek V2 and V3: multi-head latent attention (attention_mla.py), shared experts beside the
routed ones, dense first layers (first_k_dense_replace), group-limited routing
(moe.GroupLimitedRouter: V2 softmax scores, V3 sigmoid scores chosen with
`e_score_correction_bias`, both × routed_scaling_factor).

Load-balancing loss: transformers computes none for these families. With output_router_logits,
moemesh trains the Switch loss of the other families over the per-token normalised scores (see
GroupLimitedRouter). V3's `e_score_correction_bias` (kept in fp32) is loaded and saved, and training
moves it by DeepSeek's auxiliary-loss-free rule after every optimizer step, from the expert loads of
the whole global batch (train/router_bias.py, `train.router_bias_update_rate`; 0 turns it off).

Checkpoints: transformers reads and writes the per-expert layout
(`mlp.experts.J.gate_proj.weight`), which checkpoint/hf.py fuses and splits like Qwen3's; the shared experts
and the router keep their names.
"""

from moemesh.errors import ConfigError
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family, register

# transformers' defaults for what a config.json leaves out. Not q_lora_rank: absent means none (a
# full-rank q_proj, V2-Lite), as TOML run configs, which have no null, must say it.
_MLA = {"kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
_V2_DEFAULTS = {
    **_MLA,
    "n_shared_experts": 2,
    "first_k_dense_replace": 0,
    "topk_method": "greedy",
    "routed_scaling_factor": 1.0,
}
_V3_DEFAULTS = {
    **_MLA,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "rope_interleave": True,
}


def _reader(defaults: dict):
    def read(hf: dict) -> None:
        if hf.pop("mlp_bias", False):
            raise ConfigError("model config: mlp_bias is not supported")
        for name, value in defaults.items():
            hf.setdefault(name, value)
        if hf.get("num_key_value_heads") is None:
            hf["num_key_value_heads"] = hf.get("num_attention_heads", ModelConfig.num_attention_heads)
        hf["head_dim"] = hf["qk_rope_head_dim"]  # transformers' convention: the rotary dims

    return read


def _write(hf: dict, config: ModelConfig) -> None:
    hf["head_dim"] = config.qk_rope_head_dim


def _tp_plan(config: ModelConfig) -> dict[str, str]:
    layers = range(config.num_hidden_layers)
    attn = "model.layers.*.self_attn"
    plan = {
        "model.embed_tokens": "vocab",
        # Heads split; the latents (and the shared rotary key) are computed whole on every rank,
        # so their weights' gradients are partial sums over the ranks' heads.
        f"{attn}.kv_a_proj_with_mqa": "replicated_with_grad_allreduce",
        f"{attn}.kv_a_layernorm": "replicated_with_grad_allreduce",
        f"{attn}.kv_b_proj": "colwise",
        f"{attn}.o_proj": "rowwise",
        "lm_head": "vocab",
    }
    if config.q_lora_rank is None:
        plan[f"{attn}.q_proj"] = "colwise"
    else:
        plan.update(
            {
                f"{attn}.q_a_proj": "replicated_with_grad_allreduce",
                f"{attn}.q_a_layernorm": "replicated_with_grad_allreduce",
                f"{attn}.q_b_proj": "colwise",
            }
        )
    if any(config.is_moe_layer(i) for i in layers):
        plan.update(
            {
                "model.layers.*.mlp.gate": "replicated",
                "model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                "model.layers.*.mlp.experts.down_proj": "rowwise",
            }
        )
        if config.n_shared_experts:  # its partial joins the routed experts' in the block's one reduce
            plan.update(
                {
                    "model.layers.*.mlp.shared_experts.gate_proj": "colwise",
                    "model.layers.*.mlp.shared_experts.up_proj": "colwise",
                    "model.layers.*.mlp.shared_experts.down_proj": "rowwise",
                }
            )
    if not all(config.is_moe_layer(i) for i in layers):
        plan.update(
            {
                "model.layers.*.mlp.gate_proj": "colwise",
                "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise",
            }
        )
    return plan


_FIELDS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)
_COMMON = dict(
    renames={"n_routed_experts": "num_experts", "num_local_experts": "num_experts"},
    write_renames={"num_experts": "n_routed_experts"},
    write_hook=_write,
    tp_plan=_tp_plan,
    not_in_hf=("sliding_window",),
)

V2 = Family(
    model_type="deepseek_v2",
    architecture="DeepseekV2ForCausalLM",
    # V2 rotates its rope dims as complex pairs (interleaved) and never renormalises the top-k.
    fixed={
        "qk_norm": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "scoring_func": "softmax",
        "rope_interleave": True,
        "norm_topk_prob": False,
    },
    hf_fields=(*_FIELDS, "topk_method"),
    read_hook=_reader(_V2_DEFAULTS),
    **_COMMON,
)

V3 = Family(
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    fixed={
        "qk_norm": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    },
    hf_fields=(*_FIELDS, "rope_interleave"),
    read_hook=_reader(_V3_DEFAULTS),
    **_COMMON,
)
register(V2)
register(V3)
