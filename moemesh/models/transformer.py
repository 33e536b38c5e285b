"""The decoder-only MoE transformer shared by every family. Parameter names follow transformers'
module tree (`model.layers.0.mlp.experts.gate_up_proj`, ...) so state dicts line up one to one.

A decoder layer exposes its stages — attention, route, dispatch, experts, combine, aggregate — so
that a pipeline runtime can interleave them; `forward` runs them in order. With a KV cache and no
gradients (the engine's steps) `infer` runs instead: the same ops, each residual add fused into
the norm after it (the next layer's first norm, for the layer's last add), two kernels fewer a
layer of a decode step, the same bits; under tensor parallelism the partial sums over the ranks go
into those norms too (ops/summed_norm.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.attention_mla import MLAttention
from moemesh.models.config import ModelConfig
from moemesh.models.family import family
from moemesh.models.layers import Attention, DenseMLP, PagedKVCache, RMSNorm
from moemesh.models.moe import Dispatched, MoEBlock, RouterStats, Routing, load_balancing_loss
from moemesh.models.rope import RotaryEmbedding
from moemesh.ops import documents, invariant, linear_cross_entropy, recompute, summed_norm
from moemesh.ops.backend import autocast_inputs


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # None when the loss was computed without them
    loss: torch.Tensor | None = None  # ce_loss + router_aux_loss_coef * aux_loss
    aux_loss: torch.Tensor | None = None
    ce_loss: torch.Tensor | None = None  # mean next-token cross-entropy alone


class DecoderLayer(nn.Module):
    # Whether `infer` computes this layer (a family whose layer adds or norms elsewhere says False).
    fuses_residual_adds = True

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        latent = config.kv_lora_rank is not None
        self.self_attn = MLAttention(config, layer_idx) if latent else Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (
            MoEBlock(config)
            if self.is_moe
            else DenseMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        )

    # ---- stages ---------------------------------------------------------------------------------
    def attention(self, h: torch.Tensor, rope, positions: torch.Tensor, cache: PagedKVCache | None = None):
        """h + attention(norm(h)): [B, T, H] -> [B, T, H]."""
        return h + self.self_attn(self.input_layernorm(h), rope, positions, cache)

    def route(self, h: torch.Tensor, stats: bool = True) -> tuple[torch.Tensor, Routing]:
        """Normalise and flatten the tokens, choose their experts: -> (x [B*T, H], routing)."""
        x = self.post_attention_layernorm(h).flatten(0, -2)
        return x, self.mlp.route(x, stats)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        return self.mlp.dispatch(x, routing)

    def experts(self, dispatched: Dispatched) -> torch.Tensor:
        return self.mlp.compute_experts(dispatched)

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        return self.mlp.combine(expert_out, dispatched, routing, num_tokens)

    def aggregate(self, h: torch.Tensor, mlp_out: torch.Tensor) -> torch.Tensor:
        return h + mlp_out.view_as(h)

    def forward(
        self, h: torch.Tensor, rope, positions: torch.Tensor, cache: PagedKVCache | None = None
    ) -> tuple[torch.Tensor, RouterStats | None]:
        h = self.attention(h, rope, positions, cache)
        if not self.is_moe:
            return self.aggregate(h, self.mlp(self.post_attention_layernorm(h))), None
        x, routing = self.route(h, stats=cache is None)  # decoding needs no balancing statistics
        return self.aggregate(h, self.moe(x, routing)), routing.stats

    def moe(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The MoE block's output for its normalised, routed tokens x [T, H]."""
        if invariant.on():  # one path whatever the tokens: ops/invariant.py
            return self.mlp.invariant(x, routing)
        if self.mlp.reads_selected_experts(x.shape[0]):  # decoding's few tokens
            return self.mlp.selected_experts(x, routing)
        dispatched = self.dispatch(x, routing)
        return self.combine(self.experts(dispatched), dispatched, routing, x.shape[0])

    def infer(
        self, h: torch.Tensor, pending: torch.Tensor | None, rope, positions: torch.Tensor, cache: PagedKVCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` without gradients and with a cache, for (h, pending) whose sum is the layer's
        input (pending None: h is), giving its output the same way: the last residual add is left
        to the next layer's first norm (RMSNorm.after_add). Called as a method, not a module call:
        hooks on the layer itself do not run (those on its attention, router and blocks do; in
        a captured CUDA graph no Python hook runs again anyway)."""
        h, x = self.input_layernorm.after_add(h, pending)
        h, x = self.post_attention_layernorm.after_add(h, self.self_attn(x, rope, positions, cache))
        if not self.is_moe:
            return h, self.mlp(x)
        x = x.flatten(0, -2)
        return h, self.moe(x, self.mlp.route(x, stats=False)).view_as(h)


class LMHead(nn.Linear):
    """nn.Linear (the same parameter), by `ops/invariant.py` in batch-invariant mode — as a module
    call, so that what parallelism hooks on the head (TP's entry) still runs."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return invariant.linear(h, self.weight, self.bias) if invariant.on() else super().forward(h)


class TransformerBody(nn.Module):
    """Embedding, decoder layers and final norm (transformers' `model.` prefix)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer = family(config.model_type).decoder_layer or DecoderLayer
        self.layers = nn.ModuleList(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MoECausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = TransformerBody(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        rotary = family(config.model_type).rotary
        self.rotary = (
            rotary(config)
            if rotary is not None
            else RotaryEmbedding(
                config.rotary_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
            )
        )
        # Data parallelism replaces this so that the load-balancing loss sees the whole
        # micro-batch, as one process would, rather than this rank's slice of it.
        self.reduce_router_stats: Callable[[list[RouterStats]], list[RouterStats]] = lambda stats: stats
        # Tensor parallelism sets this to a cross-entropy over logits split by vocabulary (the head
        # then holds a slice of it), used instead of the fused loss that needs the whole vocabulary.
        self.vocab_parallel_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # ... and this to each row's log-probability of a target over such logits ([N, V/tp],
        # targets [N] -> [N]: reinforcement learning's per-token log-probabilities, train/logprobs.py).
        self.vocab_parallel_logprobs: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        # ... and this to the all-gather that rebuilds full-vocabulary logits from those slices
        # (generation needs them for the last position only).
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor] = lambda logits: logits
        # "none", "full" or "selective": what a decoder layer keeps for backward, and what it
        # computes again there (`ops/recompute.py`; train.activation_checkpointing).
        self.activation_checkpointing = "none"

    def tie_weights(self) -> None:
        """Share the LM head with the embedding when the config says so (again after anything
        that replaces parameters, such as `to_empty` or loading with `assign=True`)."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        cache: PagedKVCache | None = None,
        positions: torch.Tensor | None = None,
        return_logits: bool = True,
    ) -> CausalLMOutput:
        """With labels and return_logits=False (training), the loss comes from the fused
        linear cross-entropy, which never holds the [tokens, vocab] logits in fp32.

        `positions` [B, T]: each token's position in its own sequence (decoding with a KV cache,
        where rows are at different lengths); without a cache, the positions of packed rows,
        restarting at 0 where each row starts, and attention stays within each (training on
        rows packed by `data/packing.py`); default 0..T-1 in every row."""
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        if positions is None:  # one row of positions for all: the training path's rotary tables stay [T, D]
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        elif cache is None:  # a caller's positions [B, T] or [T]: packed rows, each attending within itself
            positions = positions.expand(input_ids.shape[0], -1)
            if invariant.on():  # checked (a wait for the device) in this mode only
                documents.check_rows(positions)
                if invariant.whole_rows(positions):  # the kernels' one-sequence-a-row path
                    positions = positions[0]
        h, router_stats = self.run_layers(self.model.embed_tokens(input_ids), positions, cache=cache)
        h = self.model.norm(h)

        aux_loss = None
        if output_router_logits and router_stats:
            aux_loss = load_balancing_loss(self.reduce_router_stats(router_stats), self.config.num_experts)
        logits, ce_loss = self.head(h, labels, return_logits)
        loss = ce_loss
        if loss is not None and aux_loss is not None:
            loss = ce_loss + self.config.router_aux_loss_coef * aux_loss
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux_loss, ce_loss=ce_loss)

    def next_token_logits(
        self, input_ids: torch.Tensor, cache: PagedKVCache, positions: torch.Tensor, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decoding: the logits [B, V] of each row's last position only (the next token's), or
        with `at` [S] of those tokens of the flattened batch, gathered over the vocabulary under
        tensor parallelism."""
        h, _ = self.run_layers(self.model.embed_tokens(input_ids), positions, cache=cache)
        h = h[:, -1] if at is None else h.flatten(0, 1)[at]
        return self.gather_logits(self.head(self.model.norm(h))[0])

    def run_layers(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        layers: Iterable[int] | None = None,
        cache: PagedKVCache | None = None,
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        """Hidden states through the decoder layers (all, or those indexed: a pipeline stage's),
        with the router statistics of the MoE layers among them. Under activation checkpointing
        each layer is one checkpointed region (training only: with gradients, without a cache)."""
        rope = self.rotary(positions, h.dtype)
        chosen = [self.model.layers[i] for i in (range(len(self.model.layers)) if layers is None else layers)]
        if cache is not None and not torch.is_grad_enabled() and all(layer.fuses_residual_adds for layer in chosen):
            # The engine's steps: each residual add inside the norm after it, and under tensor
            # parallelism each layer's partial sums over the ranks too (ops/summed_norm.py).
            pending = None  # a residual add that `infer` left to the next layer
            with summed_norm.sums_left_to_norms():
                for layer in chosen:
                    h, pending = layer.infer(h, pending, rope, positions, cache)
                return h if pending is None else h + summed_norm.settled(pending), []
        router_stats = []
        recompute_mode = self.activation_checkpointing if cache is None and torch.is_grad_enabled() else "none"
        for layer in chosen:
            if recompute_mode == "none":
                h, stats = layer(h, rope, positions, cache)
            else:
                h, stats = recompute.checkpointed(layer, recompute_mode, h, rope, positions)
            if stats is not None:  # a MoE layer outside decoding
                router_stats.append(stats)
        return h, router_stats

    def head(
        self, h: torch.Tensor, labels: torch.Tensor | None = None, return_logits: bool = True
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Normalised hidden states -> (logits or None, next-token loss or None)."""
        cap = self.config.final_logit_softcapping
        if labels is not None and not return_logits and self.vocab_parallel_loss is None and cap is None:
            return None, linear_cross_entropy(*autocast_inputs(h, self.lm_head.weight), shift_labels(labels))
        logits = self.lm_head(h)
        if cap is not None:  # Gemma: cap · tanh(logits / cap), elementwise (so per vocabulary slice too)
            logits = torch.tanh(logits / cap) * cap
        if labels is None:
            return logits, None
        return logits, (self.vocab_parallel_loss or next_token_loss)(logits, labels)

    def num_params(self, active: bool = False) -> int:
        """Parameters counted once (tied weights once). With active=True, only the top-k share
        of each expert bank counts: the parameters one token actually uses."""
        total = sum(p.numel() for p in self.parameters())
        if not active or self.config.num_experts == 0:
            return total
        expert = sum(p.numel() for m in self.modules() if isinstance(m, MoEBlock) for p in m.experts.parameters())
        return total - expert + expert * self.config.num_experts_per_tok // self.config.num_experts


def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Position t predicts labels[t + 1], as transformers shifts them; the last predicts nothing."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of the next token, from full logits. With no label to predict it is 0,
    still attached to the graph (not NaN as transformers gives): a data-parallel rank whose slice
    has no labels must still run its backward, whose collectives its peers wait for."""
    targets = shift_labels(labels, ignore_index).flatten()
    total = F.cross_entropy(logits.float().flatten(0, -2), targets, ignore_index=ignore_index, reduction="sum")
    return total / (targets != ignore_index).sum().clamp_min(1)
