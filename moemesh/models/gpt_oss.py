"""GPT-OSS: every layer sparse; a router with a bias, top-k on its logits then softmax over the k;
experts with biases and a clamped SwiGLU; attention with biases and sinks (a learned per-head
logit in the softmax denominator), a sliding window on the layers `layer_types` marks.

transformers stores the experts its own way: gate_up_proj [E, H, 2I] with gate and up columns
interleaved (gate = [..., ::2], up = [..., 1::2]), down_proj [E, I, H], and names the router
`mlp.router`. moemesh keeps its own layout (gate_up_proj [E, 2I, H], gate rows then up rows, so
that tensor parallelism keeps matching gate and up slices; down_proj [E, H, I]; router `mlp.gate`)
and converts exactly, both ways, at load and save.
"""

import torch

from moemesh.errors import ConfigError
from moemesh.models import mixtral
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family, register


def _read(hf: dict) -> None:
    if hf.get("router_jitter_noise", 0.0):
        raise ConfigError("model config: router_jitter_noise > 0 is not supported")
    # intermediate_size is the width of each expert; GPT-OSS has no dense layers.
    if "intermediate_size" in hf:
        hf["moe_intermediate_size"] = hf["intermediate_size"]
    if hf.get("layer_types") is None:  # transformers' default: sliding on even layers
        layers = hf.get("num_hidden_layers", ModelConfig.num_hidden_layers)
        hf["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    hf.setdefault("swiglu_alpha", 1.702)
    hf.setdefault("swiglu_limit", 7.0)
    hf.setdefault("attention_bias", True)


def _write(hf: dict, config: ModelConfig) -> None:
    hf["intermediate_size"] = config.moe_intermediate_size


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up alternating along the last dim: g0 u0 g1 u1 ..."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _state_from_hf(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        name = name.replace(".mlp.router.", ".mlp.gate.")
        if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gate | up
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1).transpose(1, 2)
        elif name.endswith(".experts.gate_up_proj_bias"):
            t = torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)
        elif name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
            t = t.transpose(1, 2)
        out[name] = t.contiguous()
    return out


def _state_to_hf(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            t = _interleave(*t.transpose(1, 2).chunk(2, dim=-1))
        elif name.endswith(".experts.gate_up_proj_bias"):
            t = _interleave(*t.chunk(2, dim=-1))
        elif name.endswith(".experts.down_proj"):
            t = t.transpose(1, 2)
        out[name.replace(".mlp.gate.", ".mlp.router.")] = t.contiguous()
    return out


def _tp_plan(config: ModelConfig) -> dict[str, str]:
    """Mixtral's plan, with the sinks and the expert biases placed."""
    return {
        **mixtral.FAMILY.tp_plan(config),
        "model.layers.*.self_attn.sinks": "colwise",  # one per head: each rank keeps its heads'
        "model.layers.*.mlp.experts.gate_up_proj_bias": "packed_colwise",
        # Added to the partial expert outputs before the block's one reduce: each rank adds
        # bias / tp, and its gradient is summed over tp after backward.
        "model.layers.*.mlp.experts.down_proj_bias": "partial_bias",
    }


FAMILY = Family(
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    renames={"num_local_experts": "num_experts"},
    write_renames={"num_experts": "num_local_experts"},
    fixed={
        "qk_norm": False,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "attention_sinks": True,
        "router_bias": True,
        "expert_bias": True,
    },
    not_in_hf=("moe_intermediate_size",),
    hf_fields=("layer_types", "swiglu_alpha", "swiglu_limit"),
    read_hook=_read,
    write_hook=_write,
    tp_plan=_tp_plan,
    state_from_hf=_state_from_hf,
    state_to_hf=_state_to_hf,
)
register(FAMILY)
