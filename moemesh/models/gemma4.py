"""Gemma 4 text MoE (transformers' Gemma4ForCausalLM, model_type "gemma4_text", enable_moe_block).

Every layer runs a dense GeGLU MLP *and* a routed expert block side by side, each with its own
norms: h + norm(norm_1(mlp(norm(h))) + norm_2(experts(norm_2'(h)))), the router reading the
un-normalised h (RMSNorm without weight, × scale × hidden^-0.5, softmax, top-k renormalised,
× per_expert_scale). Attention output is normalised before the residual too; queries, keys and
values (without weight) are RMS-normalised per head and attention is unscaled (scale 1). The
full_attention layers have their own head size (global_head_dim), rope (proportional: only a
fraction of the pairs rotate), optionally key/value heads (num_global_key_value_heads) and, with
attention_k_eq_v, values that are their keys. Embeddings are × sqrt(hidden) and logits
soft-capped. Each layer's output is × layer_scalar.

Not supported (ConfigError): per-layer input embeddings (hidden_size_per_layer_input > 0),
key/value sharing across layers (num_kv_shared_layers > 0), bidirectional attention of text
(use_bidirectional_attention "vision", images' own, is read: moemesh models text only). Under
tensor parallelism the attention_k_eq_v layers split their shared k projection by heads like
the others; where tp exceeds num_global_key_value_heads (26B-A4B's 2 at tp=4) each rank keeps a
copy of the head its query heads read (`parallel/tensor.py`).

transformers names the dense MLP `mlp` and the expert block's parts `router` / `experts` on the
layer; moemesh keeps the expert block at `mlp` (a MoEBlock, as in every family) and the dense MLP
at `dense_mlp`, renamed at load and save. Under tensor parallelism the two branches are summed in
one all-reduce a layer (`reduce_branches`), not one each.
Load-balancing loss: transformers computes none; moemesh's is the Switch loss of the others.

The hub's multimodal checkpoints (Gemma4ForConditionalGeneration, model_type "gemma4") load their
language model, skipping the vision and audio parts (checkpoint/multimodal.py); moemesh saves Gemma4ForCausalLM.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.errors import ConfigError
from moemesh.models import mixtral
from moemesh.models.config import ModelConfig
from moemesh.models.family import Family, register
from moemesh.models.layers import (
    Attention,
    DenseMLP,
    PagedKVCache,
    RMSNorm,
    attention_mask,
    paged_attention,
)
from moemesh.models.moe import MoEBlock, Routing, count_load, router_stats
from moemesh.models.rope import RotaryEmbedding
from moemesh.models.transformer import DecoderLayer
from moemesh.ops import documents
from moemesh.ops.linear import Linear
from moemesh.ops.rotary import rotary

_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight, in fp32 (Gemma4RMSNorm(with_scale=False))."""
    h = x.float()
    return (h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)).to(x.dtype)


def _head_dim(config: ModelConfig, layer_type: str) -> int:
    full = layer_type == "full_attention" and config.global_head_dim is not None
    return config.global_head_dim if full else config.attention_head_dim


def _layer_type(config: ModelConfig, layer_idx: int) -> str:
    return config.layer_types[layer_idx] if config.layer_types is not None else "sliding_attention"


class LayerTypeRotary:
    """One table per layer type: the full layers have their own head size and rope (by default
    the sliding layers')."""

    def __init__(self, config: ModelConfig):
        full = dict(config.full_attention_rope or {"rope_theta": config.rope_theta, **(config.rope_scaling or {})})
        theta = full.pop("rope_theta")
        self.tables = {
            "sliding_attention": RotaryEmbedding(
                config.attention_head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
            ),
            "full_attention": RotaryEmbedding(
                _head_dim(config, "full_attention"),
                theta,
                None if full.get("rope_type", "default") == "default" else full,
                config.max_position_embeddings,
            ),
        }

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: table(positions, dtype) for kind, table in self.tables.items()}


class Gemma4Attention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.layer_idx = layer_idx
        self.layer_type = _layer_type(config, layer_idx)
        full = self.layer_type == "full_attention"
        self.num_heads = config.num_attention_heads
        self.head_dim = _head_dim(config, self.layer_type)
        k_eq_v = config.attention_k_eq_v and full
        global_kv_heads = config.num_global_key_value_heads if full else None
        self.num_kv_heads = global_kv_heads or config.num_key_value_heads
        self.sliding_window = config.layer_sliding_window(layer_idx)
        self.eps = config.rms_norm_eps
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = None if k_eq_v else Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.sinks = None

    def forward(
        self, x: torch.Tensor, rope: dict, positions: torch.Tensor, cache: PagedKVCache | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        cos, sin = rope[self.layer_type]
        q = self.q_norm(self.q_proj(x).view(batch, seq, -1, self.head_dim))
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(batch, seq, -1, self.head_dim)
        q = rotary(q.transpose(1, 2), cos, sin)
        k = rotary(self.k_norm(k).transpose(1, 2), cos, sin)
        v = _rms(v, self.eps).transpose(1, 2)
        # scale 1: the query norm takes the place of 1/sqrt(head_dim)
        if cache is not None:
            out = paged_attention(q, k, v, cache, self.layer_idx, 1.0, self.sliding_window)
        elif positions.dim() == 2:  # packed rows, each attending within itself (ops/documents.py)
            window = self.sliding_window if self.sliding_window is not None and seq > self.sliding_window else None
            out = documents.attention(q, k, v, positions, scale=1.0, window=window)
        else:
            plain_causal = self.sliding_window is None or seq <= self.sliding_window
            mask = None if plain_causal else attention_mask(positions, seq, self.sliding_window)
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=plain_causal,
                scale=1.0,
                enable_gqa=self.num_kv_heads != self.num_heads,
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Gemma4Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.eps, self.root = config.rms_norm_eps, config.hidden_size**-0.5
        self.proj = Linear(config.hidden_size, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.empty(config.num_experts))
        self.top_k = config.num_experts_per_tok
        self.expert_load: torch.Tensor | None = None  # see `moe.count_load`

    def forward(self, x: torch.Tensor, stats: bool = True) -> Routing:
        probs = torch.softmax(self.proj(_rms(x, self.eps) * self.scale * self.root), dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        # In the routing weights, so that it multiplies the (under TP partial) expert outputs
        # before the block's one reduce.
        weights = weights * self.per_expert_scale[expert_ids]
        if not stats:
            return Routing(weights, expert_ids, None)
        counted = router_stats(probs, expert_ids)
        count_load(self, counted)
        return Routing(weights, expert_ids, counted)


class Gemma4DecoderLayer(DecoderLayer):
    fuses_residual_adds = False  # its adds meet norms of their own (and a scalar), not the next layer's

    def __init__(self, config: ModelConfig, layer_idx: int):
        nn.Module.__init__(self)
        self.is_moe = True
        hidden, eps = config.hidden_size, config.rms_norm_eps
        # transformers scales the embeddings by sqrt(hidden); here the first layer does, as tensor
        # parallelism replaces the embedding module (the same product either way).
        self.embed_scale = hidden**0.5 if layer_idx == 0 else None
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.dense_mlp = DenseMLP(hidden, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.mlp = MoEBlock(config)
        self.mlp.gate = Gemma4Router(config)
        self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Buffer(torch.ones(1))
        # The two branches' outputs, each summed over tensor-parallel ranks before its own
        # post-norm: the identity here. Tensor parallelism makes it one all-reduce of both, the
        # dense MLP's down projection and the expert block leaving their partial sums to it
        # (llama.cpp's one reduce a layer for this model's two branches).
        self.reduce_branches: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]] = lambda *both: both

    def attention(self, h: torch.Tensor, rope, positions: torch.Tensor, cache: PagedKVCache | None = None):
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale).to(h.dtype)
        return h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, positions, cache))

    def route(self, h: torch.Tensor, stats: bool = True) -> tuple[torch.Tensor, Routing]:
        """The router reads h itself, the experts its normalised copy."""
        flat = h.flatten(0, -2)
        return self.pre_feedforward_layernorm_2(flat), self.mlp.route(flat, stats)

    def aggregate(self, h: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        dense, experts = self.reduce_branches(self.dense_mlp(self.pre_feedforward_layernorm(h)), mlp_out.view_as(h))
        dense, experts = self.post_feedforward_layernorm_1(dense), self.post_feedforward_layernorm_2(experts)
        return (h + self.post_feedforward_layernorm(dense + experts)) * self.layer_scalar


# ---- config.json ------------------------------------------------------------------------------
def _read(hf: dict) -> None:
    # "vision": image tokens attend to each other both ways, text stays causal — and moemesh
    # models text only (the published 26B-A4B says so); text attending both ways is not supported.
    if hf.get("use_bidirectional_attention") == "vision":
        hf.pop("use_bidirectional_attention")
    unsupported = {"hidden_size_per_layer_input": 256, "num_kv_shared_layers": 0, "use_bidirectional_attention": None}
    for name, default in unsupported.items():
        if hf.pop(name, default):
            raise ConfigError(f"model config: gemma4 {name} is not supported")
    if not hf.pop("enable_moe_block", False):
        raise ConfigError("model config: gemma4 without enable_moe_block is a dense model (not supported)")
    hf.pop("use_double_wide_mlp", None)  # only widens the MLPs of key/value-sharing layers
    defaults = {
        "tie_word_embeddings": True,
        "sliding_window": 512,
        "rms_norm_eps": 1e-6,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
    }
    for name, value in defaults.items():
        hf.setdefault(name, value)
    layers = hf.get("num_hidden_layers", ModelConfig.num_hidden_layers)
    if hf.get("layer_types") is None:  # transformers' default: every sixth layer full
        hf["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    hf["layer_types"] = [*hf["layer_types"][:-1], "full_attention"]  # transformers forces the last one full
    rope = hf.pop("rope_parameters", None) or _DEFAULT_ROPE
    if set(rope) != {"sliding_attention", "full_attention"}:
        raise ConfigError(f"model config: gemma4 rope_parameters must be given per layer type, got {rope}")
    hf["rope_parameters"], hf["full_attention_rope"] = rope["sliding_attention"], dict(rope["full_attention"])
    overrides, global_head_dim = hf.pop("per_layer_config", None), hf.pop("global_head_dim", 512)
    if overrides is None:  # transformers' default, from global_head_dim
        overrides = {i: {"head_dim": global_head_dim} for i, t in enumerate(hf["layer_types"]) if t == "full_attention"}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            for values in overrides.values():
                values["num_key_value_heads"] = hf["num_global_key_value_heads"]
    full = list(overrides.values())
    if any(v != full[0] or set(v) - {"head_dim", "num_key_value_heads"} for v in full):
        raise ConfigError(f"model config: gemma4 per_layer_config must be the same on every full layer: {overrides}")
    values = full[0] if full else {}
    hf["global_head_dim"] = values.get("head_dim", hf.get("head_dim"))
    hf["num_global_key_value_heads"] = values.get("num_key_value_heads")


def _write(hf: dict, config: ModelConfig) -> None:
    hf.pop("rope_theta")
    hf["rope_parameters"] = {"sliding_attention": hf["rope_parameters"], "full_attention": config.full_attention_rope}
    full = {"head_dim": config.global_head_dim}
    if config.num_global_key_value_heads is not None:
        full["num_key_value_heads"] = config.num_global_key_value_heads
    hf["per_layer_config"] = {str(i): dict(full) for i, t in enumerate(config.layer_types) if t == "full_attention"}
    hf.update(enable_moe_block=True, hidden_size_per_layer_input=0, num_kv_shared_layers=0)


# ---- checkpoints: transformers' names <-> moemesh's -------------------------------------------
_FROM_HF = [(r"\.mlp\.", ".dense_mlp."), (r"\.router\.", ".mlp.gate."), (r"\.experts\.", ".mlp.experts.")]
_TO_HF = [(r"\.mlp\.gate\.", ".router."), (r"\.mlp\.experts\.", ".experts."), (r"\.dense_mlp\.", ".mlp.")]


def _renamer(rules):
    def rename(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors.items():
            for pattern, repl in rules:
                if re.search(pattern, name):
                    name = re.sub(pattern, repl, name)
                    break
            out[name] = t
        return out

    return rename


def _tp_plan(config: ModelConfig) -> dict[str, str]:
    """Mixtral's plan (attention, router, experts, vocabulary) with the per-head norms and the
    dense MLP beside the experts. per_expert_scale lives in the routing weights: it multiplies
    the partial expert outputs before the block's one reduce, its gradient handled with the
    router's."""
    attn = "model.layers.*.self_attn"
    return {
        **mixtral.FAMILY.tp_plan(config),
        # one norm shared by all heads, applied here to this rank's heads
        f"{attn}.q_norm": "replicated_with_grad_allreduce",
        f"{attn}.k_norm": "replicated_with_grad_allreduce",
        "model.layers.*.dense_mlp.gate_proj": "colwise",
        "model.layers.*.dense_mlp.up_proj": "colwise",
        "model.layers.*.dense_mlp.down_proj": "rowwise",
    }


FAMILY = Family(
    model_type="gemma4_text",
    architecture="Gemma4ForCausalLM",
    renames={"hidden_activation": "hidden_act", "top_k_experts": "num_experts_per_tok"},
    write_renames={"hidden_act": "hidden_activation", "num_experts_per_tok": "top_k_experts"},
    fixed={"qk_norm": True, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []},
    hf_fields=("layer_types", "attention_k_eq_v", "final_logit_softcapping"),
    read_hook=_read,
    write_hook=_write,
    tp_plan=_tp_plan,
    state_from_hf=_renamer(_FROM_HF),
    state_to_hf=_renamer(_TO_HF),
    decoder_layer=Gemma4DecoderLayer,
    rotary=LayerTypeRotary,
)
register(FAMILY)
