"""The Mixture-of-Experts block, cut into the stages a pipeline can interleave:

    route     router logits -> top-k experts and their weights per token
    dispatch  copy each token to the experts it chose, grouped by expert
    experts   one grouped matmul per projection over all experts
    combine   weighted sum of each token's k expert outputs

`dispatch` and `combine` belong to the block's `dispatcher`: `LocalDispatcher` here, an
all-to-all dispatcher under expert parallelism. Combine ends with the block's `reduce_output`
(identity here, an all-reduce under tensor parallelism). `forward` is the stages in order.

For up to SELECTED_EXPERT_ROWS (token, expert) pairs without gradients (decoding),
`selected_experts` is the block in one go: the tokens through their k experts by `expert_gemv`,
each chosen expert's weights read once, then the same weighted sum and reduce. The staged path
above is its reference. In batch-invariant mode (`invariant`) the same tokens take
`ops/invariant.py`'s `selected_experts` on its kernels' device: the dispatched path's bits
without the dispatch's and tile table's small kernels, which made most of a decode step's
kernels in that mode; beyond, and on the CPU reference, the mode dispatches.

`RoutingRecorder` keeps the experts each block chose for each token, so that two forwards of the
same tokens (the engine's and the trainer's: reinforcement learning) can be compared decision by
decision. Off by default: a block then pays one attribute test per forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.config import ModelConfig
from moemesh.models.layers import ACTIVATIONS, DenseMLP
from moemesh.ops import combine, invariant, permute, recompute, swiglu
from moemesh.ops.backend import autocast_inputs, use_triton
from moemesh.ops.combine import combine_pairs
from moemesh.ops.expert_gemv import expert_gemv, expert_gemv_combine, expert_pair_gemv, expert_swiglu_gemv
from moemesh.ops.grouped_mm import group_offsets, grouped_mm
from moemesh.ops.linear import linear
from moemesh.ops.low_rank import low_rank_factors
from moemesh.ops.swiglu import clamped_swiglu
from moemesh.ops.topk_softmax import choice_counts, routed, topk_softmax

# (token, expert) pairs up to which a block without gradients reads only the chosen experts'
# weights, each once (`MoEBlock.selected_experts`); beyond, the grouped GEMM (prefill, training).
# Up to PER_TOKEN_ROWS pairs the SwiGLU experts run per token instead (`ops/expert_gemv.py`).
# bench/serve/decode.py measures the paths at each batch size (batch 64 of top-8 is 512 pairs).
SELECTED_EXPERT_ROWS = 1024
PER_TOKEN_ROWS = 64


@dataclass
class Routing:
    weights: torch.Tensor  # [T, k] fp32 routing weights of the chosen experts
    expert_ids: torch.Tensor  # [T, k] int64
    stats: RouterStats | None  # None where the caller asked for none (decoding)
    # The shared experts' output (DeepSeek), added to the routed experts' before the block's reduce.
    shared: torch.Tensor | None = None


@dataclass
class RouterStats:
    """What the load-balancing loss needs from one MoE layer: per expert, how many token slots
    chose it (no gradient) and the sum of its router probabilities (with gradient)."""

    counts: torch.Tensor  # [E] fp32
    prob_sum: torch.Tensor  # [E] fp32
    num_tokens: int


def router_stats(probs: torch.Tensor, expert_ids: torch.Tensor) -> RouterStats:
    """What the load-balancing loss needs of one router: the (token, slot) choices per expert and
    the summed probabilities [T, E]."""
    return RouterStats(choice_counts(expert_ids, probs.shape[-1]), probs.sum(dim=0), probs.shape[0])


def count_load(router: nn.Module, stats: RouterStats) -> None:
    """Add a training forward's (token, slot) choices per expert to `router.expert_load` (int64,
    so that they add up exactly); evaluation and generation forwards do not count, nor the forward
    that activation checkpointing runs again in backward. Read by the
    trainer after each step (the per-expert load metrics, DeepSeek-V3's bias rule), then zeroed.
    Added in place, into the same tensor step after step: a step captured as a CUDA graph
    (train/cuda_graph.py) adds into the tensor it was captured with."""
    if router.training and torch.is_grad_enabled() and not recompute.recomputing():  # once, not again in backward
        if router.expert_load is None:
            router.expert_load = torch.zeros(stats.counts.shape, dtype=torch.long, device=stats.counts.device)
        router.expert_load.add_(stats.counts.long())  # whole numbers, exact in fp32 below 2**24 choices a forward


class Router(nn.Module):
    """Softmax over experts in fp32, top-k, optionally renormalised over the k.

    Mixtral's and GPT-OSS's "top-k on logits, then softmax over the k" is the same function as
    softmax -> top-k -> renormalise, so one router serves these families. GPT-OSS adds a bias to
    the logits."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.expert_load: torch.Tensor | None = None  # see `count_load`; not part of the model's state

    def forward(self, x: torch.Tensor, stats: bool = True) -> Routing:
        """`stats=False` (decoding): the choice alone, the logits by `ops/gemv.py` and the choice
        in one kernel on a Triton device."""
        if not stats and not torch.is_grad_enabled() and not invariant.on():
            logits = linear(x, self.weight, self.bias)
            return Routing(*topk_softmax(logits, self.top_k, self.norm_topk_prob), stats=None)
        logits = invariant.linear(x, self.weight, self.bias) if invariant.on() else F.linear(x, self.weight, self.bias)
        probs, weights, expert_ids, counts = routed(logits, self.top_k, self.norm_topk_prob)  # one kernel each way
        if not stats:
            return Routing(weights, expert_ids, None)
        stats = RouterStats(counts, probs.sum(dim=0), probs.shape[0])
        count_load(self, stats)
        return Routing(weights, expert_ids, stats)


class GroupLimitedRouter(nn.Module):
    """DeepSeek's router, in fp32 as transformers computes it. Scores are a softmax (V2) or
    sigmoids (V3); experts form n_group groups, each token picks its topk_group best groups (V2:
    by their best score; V3: by the sum of their two best biased scores) and its top-k experts
    inside them. V3 adds `e_score_correction_bias` for the choice only: the weights are the
    unbiased scores, renormalised over the k if norm_topk_prob. Then × routed_scaling_factor.

    Load-balancing statistics (transformers computes no auxiliary loss for these families):
    the Switch loss over the scores normalised to sum to one per token, i.e. the softmax for V2
    and sigmoid / Σ sigmoid for V3 (DeepSeek-V3's balance loss, pooled over the batch).

    V3's bias is moved by DeepSeek's auxiliary-loss-free rule after each optimizer step
    (train/router_bias.py), from `expert_load`: the (token, slot) choices of each expert, added
    up over the training forwards (grad enabled) since the last update (`count_load`). The bias stays fp32
    whatever the model's dtype, as in transformers: bf16 could not hold its small steps."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.sigmoid = config.scoring_func == "sigmoid"
        self.limit_groups = config.topk_method in ("group_limited_greedy", "noaux_tc")
        self.n_group, self.topk_group = config.n_group or 1, config.topk_group or 1
        self.norm_topk_prob = config.norm_topk_prob and self.sigmoid  # V2 never renormalises
        self.scaling = config.routed_scaling_factor
        if self.sigmoid:  # a buffer: set by the balancing rule, not by gradients
            # fp32 whatever the default dtype (a model built in bf16 on the meta device: `_apply`)
            self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # Not a buffer: no part of the model's state (checkpoints, dtype and meta-device loading
        # leave it alone); int64 so that the counts add up exactly.
        self.expert_load: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, stats: bool = True) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias if self.sigmoid else scores
        if self.limit_groups:
            grouped = choice.view(-1, self.n_group, choice.shape[-1] // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1) if self.sigmoid else grouped.max(dim=-1).values
            chosen = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, 1)
            outside = (chosen == 0).repeat_interleave(grouped.shape[-1], dim=1)
            choice = choice.masked_fill(outside, float("-inf") if self.sigmoid else 0.0)
        expert_ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        if not stats:
            return Routing(weights, expert_ids, None)
        probs = scores / scores.sum(dim=-1, keepdim=True) if self.sigmoid else scores
        counted = router_stats(probs, expert_ids)
        count_load(self, counted)
        return Routing(weights, expert_ids, counted)

    def _apply(self, fn, recurse=True):
        """Moves (`to`, `to_empty`, `cuda`) keep the correction bias fp32."""
        bias = self._buffers.pop("e_score_correction_bias", None)
        super()._apply(fn, recurse)
        if bias is not None:
            moved = fn(bias)
            if moved.dtype != torch.float32:  # a cast: move the fp32 values instead
                moved = bias.to(device=moved.device, dtype=torch.float32)
            self._buffers["e_score_correction_bias"] = moved
        return self


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss exactly as transformers computes it: token fractions
    and mean probabilities are pooled over all MoE layers first, then multiplied."""
    total_tokens = sum(s.num_tokens for s in stats)
    token_fraction = torch.stack([s.counts for s in stats]).sum(0) / total_tokens
    mean_prob = torch.stack([s.prob_sum for s in stats]).sum(0) / total_tokens
    return num_experts * torch.sum(token_fraction * mean_prob)


# The fused per-expert tensors of a bank, each [E, out, in], in the order transformers registers them.
EXPERT_BANKS = ("gate_up_proj", "down_proj")


class Experts(nn.Module):
    """All experts of one layer, stored fused as transformers does: gate_up_proj [E, 2I, H]
    (gate rows first, then up rows) and down_proj [E, H, I]; with `expert_bias` (GPT-OSS) also
    gate_up_proj_bias [E, 2I] (same order) and down_proj_bias [E, H]. LoRA (`models/lora.py`) may
    add per-expert factors <bank>_lora_A [E, r, in] and <bank>_lora_B [E, out, r], computed by the
    same grouped GEMMs: each expert's rows times its A, then its B."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        num_experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.gate_up_proj_bias = self.down_proj_bias = None
        if config.expert_bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inner))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        self.activation = swiglu
        if config.hidden_act != "silu":  # GeGLU (Gemma)
            self.activation = functools.partial(_glu, ACTIVATIONS[config.hidden_act])
        # GPT-OSS's clamped SwiGLU: (alpha, limit), which the decoding kernels fuse too.
        self.swiglu_clamp = None
        if config.swiglu_limit is not None:
            self.swiglu_clamp = (config.swiglu_alpha, config.swiglu_limit)
            self.activation = functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
        # The share of down_proj_bias each copy of the output adds. Tensor parallelism makes the
        # output a partial sum that is reduced once per block, so there every rank adds bias / tp.
        self.down_bias_share = 1.0
        # LoRA's scaling (alpha / rank) per bank that has adapters, and the dropout on their input.
        self.lora_scaling: dict[str, float] = {}
        self.lora_dropout = 0.0

    @property
    def has_adapters(self) -> bool:
        return bool(self.lora_scaling)

    def _low_rank(self, bank: str, x: torch.Tensor) -> dict:
        """grouped_mm's LoRA arguments for `bank` (the factors in x's dtype, B scaled), or none
        when the bank has no adapters."""
        if bank not in self.lora_scaling:
            return {}
        a, b = getattr(self, f"{bank}_lora_A"), getattr(self, f"{bank}_lora_B")
        factors = low_rank_factors(a, b, x.dtype, self.lora_scaling[bank])
        dropped = F.dropout(x, self.lora_dropout) if self.lora_dropout and self.training else None
        return {"low_rank": factors, "x_low_rank": dropped}

    def forward(
        self,
        grouped: torch.Tensor,
        group_sizes: torch.Tensor | None = None,
        expert_ids: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        first_expert: int | None = None,
    ) -> torch.Tensor:
        """grouped [N, H], rows sorted by expert, group_sizes [E] of them each: the grouped GEMMs.
        Or, given expert_ids and routing weights [T, k], grouped is x [T, H] and each token goes
        through its chosen experts, weighted and summed (`selected`). Both through `forward`, so
        that what wraps the module runs (FSDP gathering the shards of the bank)."""
        if expert_ids is not None:
            return self.selected(grouped, expert_ids, weights, first_expert)
        (grouped,) = autocast_inputs(grouped)
        offsets = group_offsets(grouped, group_sizes)  # once for the layer's grouped GEMMs
        gate_up = grouped_mm(
            grouped, self.gate_up_proj, group_sizes, offsets, **self._low_rank("gate_up_proj", grouped)
        )
        if self.gate_up_proj_bias is not None:
            gate_up = gate_up + _per_row(self.gate_up_proj_bias, group_sizes, gate_up)
        gated = self.activation(gate_up)
        out = grouped_mm(gated, self.down_proj, group_sizes, offsets, **self._low_rank("down_proj", gated))
        if self.down_proj_bias is not None:
            out = out + _per_row(self.down_proj_bias * self.down_bias_share, group_sizes, out)
        return out

    def selected(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, first_expert: int | None = None
    ) -> torch.Tensor:
        """x [T, H] through each token's experts expert_ids [T, k], summed with the routing
        weights [T, k] -> [T, H] (no autograd through the kernels: inference). SwiGLU experts
        without biases fuse the activation into the gate/up GEMV, and for the fewest tokens run
        per token with the weighted sum fused too (`ops/expert_gemv.py`) — GPT-OSS's too, its
        biases and clamped SwiGLU in the same two kernels; others (GeGLU) run per token for the
        fewest, the activation in torch between the two kernels; quantized banks are
        read in their codes by the same kernels, with no host sync. `first_expert`: this
        bank holds the experts first_expert .. first_expert + E - 1 of the ids (expert
        parallelism over tokens every rank holds); the other ranks' pairs add nothing here, and
        no biases then."""
        plain = self.activation is swiglu and self.gate_up_proj_bias is None
        num_experts = self.gate_up_proj.shape[0]
        # A quantized bank (ops/quantized_weight.py) is read as it is: the kernels decode the
        # chosen experts' tiles in registers, the references dequantize the chosen experts.
        gate_up_proj, down_proj = self.gate_up_proj, self.down_proj
        if first_expert is not None and (self.gate_up_proj_bias is not None or self.down_proj_bias is not None):
            raise ValueError("the selected experts of one rank among several take no expert biases")
        first = first_expert or 0
        if use_triton(x) and expert_ids.numel() <= PER_TOKEN_ROWS:
            if self.activation is swiglu or self.swiglu_clamp is not None:  # the kernels' activations
                gated = expert_swiglu_gemv(
                    x, gate_up_proj, expert_ids, first, bias=self.gate_up_proj_bias, clamp=self.swiglu_clamp
                )
                return expert_gemv_combine(
                    gated,
                    down_proj,
                    expert_ids,
                    weights,
                    first,
                    early_ids=True,
                    bias=self.down_proj_bias,
                    bias_share=self.down_bias_share,
                )
            gate_up = expert_pair_gemv(x, gate_up_proj, expert_ids, first, bias=self.gate_up_proj_bias)
            return expert_gemv_combine(
                self.activation(gate_up),
                down_proj,
                expert_ids,
                weights,
                first,
                bias=self.down_proj_bias,
                bias_share=self.down_bias_share,
            )
        if plain:
            gated = expert_gemv(x, gate_up_proj, expert_ids, glu=True, first_expert=first)
        else:
            gate_up = expert_gemv(x, gate_up_proj, expert_ids, first_expert=first)
            if self.gate_up_proj_bias is not None:
                gate_up = gate_up + self.gate_up_proj_bias[expert_ids.flatten()].to(gate_up.dtype)
            gated = self.activation(gate_up)
        out = expert_gemv(gated, down_proj, expert_ids.view(-1, 1), first_expert=first)
        if self.down_proj_bias is not None:
            out = out + (self.down_proj_bias[expert_ids.flatten()] * self.down_bias_share).to(out.dtype)
        return combine_pairs(out, expert_ids, weights, first, None if first_expert is None else num_experts)


def _glu(act, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up of a [rows, gate | up] tensor, in fp32 like swiglu."""
    gate, up = gate_up.to(torch.promote_types(gate_up.dtype, torch.float32)).chunk(2, dim=-1)
    return (act(gate) * up).to(gate_up.dtype)


def _per_row(bias: torch.Tensor, group_sizes: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each expert's bias repeated over its rows ([E, D] -> [N, D]), zeros for the rows past the
    last group (`grouped_mm`'s rest); output_size avoids a host sync."""
    rest = rows.shape[0] - group_sizes.sum()
    padded = torch.cat([bias.to(rows.dtype), bias.new_zeros(1, bias.shape[1], dtype=rows.dtype)])
    sizes = torch.cat([group_sizes, rest.view(1).to(group_sizes.dtype)])
    return torch.repeat_interleave(padded, sizes, dim=0, output_size=rows.shape[0])


@dataclass
class Dispatched:
    grouped: torch.Tensor  # [N, H] token copies sorted by expert
    group_sizes: torch.Tensor  # [E_local] rows per local expert
    state: Any  # what the dispatcher needs to combine


class LocalDispatcher:
    """All experts live here: copy the tokens into expert order (`permute`), and add each token's
    expert outputs back, weighted (`combine`, whose backward also yields the routing-weight
    gradient)."""

    local = True  # every expert is on this rank (`MoEBlock.selected_experts` may run)

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        permuted = permute(x, routing.expert_ids, num_experts)
        return Dispatched(permuted.grouped, permuted.offsets.diff(), state=permuted.position)

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        return combine(expert_out, dispatched.state, routing.weights)


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = GroupLimitedRouter(config) if config.topk_method is not None else Router(config)
        self.experts = Experts(config)
        # DeepSeek's shared experts: one dense SwiGLU that every token passes through.
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = DenseMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act
            )
        self.dispatcher = LocalDispatcher()
        # Tensor parallelism replaces this with the block's one all-reduce: the expert outputs are
        # partial sums there, and the weighted top-k sum of combine is linear in them.
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] = lambda out: out
        # A list while a `RoutingRecorder` records: each forward's chosen experts [T, k], sorted.
        self.routing_record: list[torch.Tensor] | None = None

    def route(self, x: torch.Tensor, stats: bool = True) -> Routing:
        """`stats=False`: no load-balancing statistics (decoding)."""
        routing = self.gate(x, stats=stats)
        if self.routing_record is not None and not recompute.recomputing():  # once, not again in backward
            self.routing_record.append(routing.expert_ids.detach().sort(dim=-1).values)
        if self.shared_experts is not None:
            routing = dataclasses.replace(routing, shared=self.shared_experts(x))
        return routing

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        return self.dispatcher.dispatch(x, routing, self.num_experts)

    def compute_experts(self, dispatched: Dispatched) -> torch.Tensor:
        return self.experts(dispatched.grouped, dispatched.group_sizes)

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        return self._finish(self.dispatcher.combine(expert_out, dispatched, routing, num_tokens), routing)

    def reads_selected_experts(self, num_tokens: int) -> bool:
        """Whether `selected_experts` serves these tokens: few of them, no gradients, every
        expert on this rank — or this rank's share of them where every rank holds the tokens
        (`first_expert`: expert parallelism for decoding, whole experts over tensor parallelism;
        experts without biases)."""
        e = self.experts
        here = self.dispatcher.local or (
            getattr(self.dispatcher, "first_expert", None) is not None
            and e.gate_up_proj_bias is None
            and e.down_proj_bias is None
        )
        return (
            not torch.is_grad_enabled()
            and num_tokens * self.gate.top_k <= SELECTED_EXPERT_ROWS
            and here
            and not e.has_adapters  # the decoding kernels read the base weights only (merge first)
        )

    def selected_experts(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> [T, H], reading only the chosen experts' weights (of those on this rank)."""
        first = None if self.dispatcher.local else self.dispatcher.first_expert
        out = self.experts(x, expert_ids=routing.expert_ids, weights=routing.weights, first_expert=first)
        return self._finish(out, routing)

    def invariant(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x [T, H] -> [T, H] in batch-invariant mode: the block's own dispatch and combine (any
        layout), each dispatched row through its expert alone (`ops/invariant.py`).

        On the kernels' device, where `selected_experts` would serve the tokens (a decode step:
        no gradients, up to SELECTED_EXPERT_ROWS pairs, every expert here, no adapters), the
        pairs instead go straight through `invariant.selected_experts` (the same bits a row,
        expert biases included) in (token, slot) order and `combine` sums them at the identity
        positions — the local dispatcher's combine, the same op in the same slot order, so the
        block's output is the dispatched path's bit for bit. That spares a decode step the
        dispatch's and the tile table's small kernels, about 40 a layer: with them, at batch 64
        of the 48-layer Qwen3-30B-A3B shape on an H200, the mode ran 3,243 kernels a step
        against the default path's 891 and took 1.33× its time, its matmul as fast as the
        default's; without them 1.20× (docs/benchmarks.md, 2026-11-27)."""
        if self.experts.has_adapters:
            raise ValueError("batch-invariant mode does not cover LoRA adapters: merge them first")
        e = self.experts
        down_bias = None if e.down_proj_bias is None else e.down_proj_bias * e.down_bias_share
        if invariant.kernels(x) and self.dispatcher.local and self.reads_selected_experts(x.shape[0]):
            out = invariant.selected_experts(
                x, routing.expert_ids, e.gate_up_proj, e.down_proj, e.activation, e.gate_up_proj_bias, down_bias
            )
            positions = torch.arange(out.shape[0], device=out.device).view_as(routing.expert_ids)
            return self._finish(combine(out, positions, routing.weights), routing)
        dispatched = self.dispatch(x, routing)
        out = invariant.experts(
            dispatched.grouped,
            dispatched.group_sizes,
            e.gate_up_proj,
            e.down_proj,
            e.activation,
            e.gate_up_proj_bias,
            down_bias,
        )
        return self.combine(out, dispatched, routing, x.shape[0])

    def _finish(self, out: torch.Tensor, routing: Routing) -> torch.Tensor:
        if routing.shared is not None:  # under TP both are partial sums: one reduce for the two
            out = out + routing.shared
        return self.reduce_output(out)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x: [T, H] -> ([T, H], router statistics for the load-balancing loss)."""
        routing = self.route(x)
        dispatched = self.dispatch(x, routing)
        out = self.combine(self.compute_experts(dispatched), dispatched, routing, x.shape[0])
        return out, routing.stats


class RoutingRecorder:
    """The experts every MoE block of `model` chooses for each token, while recording (a context
    manager, or `start`/`stop`). `take()` returns the choices since the last take as one tensor
    [T, L, k]: token, MoE layer (in model order), the k chosen expert ids sorted ascending (the
    set is the decision; the order among the k is the router's business). T is the tokens of the
    forwards since the last take, in the order they ran, flattened as the block sees them.

    Limits: eager forwards only — a replayed CUDA graph runs no Python, so it records nothing; the
    tokens of an expert-parallel forward are this rank's."""

    def __init__(self, model: nn.Module):
        self.blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]

    def start(self) -> RoutingRecorder:
        for block in self.blocks:
            block.routing_record = []
        return self

    def stop(self) -> None:
        for block in self.blocks:
            block.routing_record = None

    __enter__ = start

    def __exit__(self, *exc) -> None:
        self.stop()

    def take(self) -> torch.Tensor:
        records = []
        for block in self.blocks:
            if block.routing_record is None:
                raise RuntimeError("RoutingRecorder.take: not recording (call start() first)")
            records.append(torch.cat(block.routing_record) if block.routing_record else None)
            block.routing_record = []
        if not records or all(r is None for r in records):
            return torch.zeros(0, len(records), 0, dtype=torch.long)
        if any(r is None or r.shape[0] != records[0].shape[0] for r in records):
            raise RuntimeError(
                "RoutingRecorder.take: the MoE layers saw different numbers of tokens (a forward cut short?)"
            )
        return torch.stack(records, dim=1)
