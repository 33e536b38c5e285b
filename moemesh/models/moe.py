"""The Mixture-of-Experts block, cut into the stages a pipeline can interleave:

    route     router logits -> top-k experts and their weights per token
    dispatch  copy each token to the experts it chose, grouped by expert
    experts   one grouped matmul per projection over all experts
    combine   weighted sum of each token's k expert outputs

`dispatch` and `combine` belong to the block's `dispatcher`: `LocalDispatcher` here, an
all-to-all dispatcher under expert parallelism. Combine ends with the block's `reduce_output`
(identity here, an all-reduce under tensor parallelism). `forward` is the stages in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.config import ModelConfig
from moemesh.ops import combine, permute, swiglu
from moemesh.ops.grouped_mm import grouped_mm


@dataclass
class Routing:
    weights: torch.Tensor  # [T, k] fp32 routing weights of the chosen experts
    expert_ids: torch.Tensor  # [T, k] int64
    stats: RouterStats


@dataclass
class RouterStats:
    """What the load-balancing loss needs from one MoE layer: per expert, how many token slots
    chose it (no gradient) and the sum of its router probabilities (with gradient)."""

    counts: torch.Tensor  # [E] fp32
    prob_sum: torch.Tensor  # [E] fp32
    num_tokens: int


class Router(nn.Module):
    """Softmax over experts in fp32, top-k, optionally renormalised over the k.

    Mixtral's "top-k on logits, then softmax over the k" is the same function as softmax ->
    top-k -> renormalise, so one router serves both families."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        with torch.no_grad():
            counts = torch.zeros(probs.shape[-1], device=x.device, dtype=torch.float32)
            counts.index_add_(0, expert_ids.flatten(), torch.ones(expert_ids.numel(), device=x.device))
        return Routing(weights, expert_ids, RouterStats(counts, probs.sum(dim=0), x.shape[0]))


def load_balancing_loss(stats: list[RouterStats], num_experts: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss exactly as transformers computes it: token fractions
    and mean probabilities are pooled over all MoE layers first, then multiplied."""
    total_tokens = sum(s.num_tokens for s in stats)
    token_fraction = torch.stack([s.counts for s in stats]).sum(0) / total_tokens
    mean_prob = torch.stack([s.prob_sum for s in stats]).sum(0) / total_tokens
    return num_experts * torch.sum(token_fraction * mean_prob)


class Experts(nn.Module):
    """All experts of one layer, stored fused as transformers does: gate_up_proj [E, 2I, H]
    (gate rows first, then up rows) and down_proj [E, H, I]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        num_experts, hidden, inner = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))

    def forward(self, grouped: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
        return grouped_mm(swiglu(grouped_mm(grouped, self.gate_up_proj, group_sizes)), self.down_proj, group_sizes)


@dataclass
class Dispatched:
    grouped: torch.Tensor  # [N, H] token copies sorted by expert
    group_sizes: torch.Tensor  # [E_local] rows per local expert
    state: Any  # what the dispatcher needs to combine


class LocalDispatcher:
    """All experts live here: copy the tokens into expert order (`permute`), and add each token's
    expert outputs back, weighted (`combine`, whose backward also yields the routing-weight
    gradient)."""

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        permuted = permute(x, routing.expert_ids, num_experts)
        return Dispatched(permuted.grouped, permuted.offsets.diff(), state=permuted.position)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing,
                num_tokens: int) -> torch.Tensor:
        return combine(expert_out, dispatched.state, routing.weights)


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.gate = Router(config)
        self.experts = Experts(config)
        self.dispatcher = LocalDispatcher()
        # Tensor parallelism replaces this with the block's one all-reduce: the expert outputs are
        # partial sums there, and the weighted top-k sum of combine is linear in them.
        self.reduce_output: Callable[[torch.Tensor], torch.Tensor] = lambda out: out

    def route(self, x: torch.Tensor) -> Routing:
        return self.gate(x)

    def dispatch(self, x: torch.Tensor, routing: Routing) -> Dispatched:
        return self.dispatcher.dispatch(x, routing, self.num_experts)

    def compute_experts(self, dispatched: Dispatched) -> torch.Tensor:
        return self.experts(dispatched.grouped, dispatched.group_sizes)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing,
                num_tokens: int) -> torch.Tensor:
        return self.reduce_output(self.dispatcher.combine(expert_out, dispatched, routing, num_tokens))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, RouterStats]:
        """x: [T, H] -> ([T, H], router statistics for the load-balancing loss)."""
        routing = self.route(x)
        dispatched = self.dispatch(x, routing)
        out = self.combine(self.compute_experts(dispatched), dispatched, routing, x.shape[0])
        return out, routing.stats
