"""Data parallelism over the "batch" group (dp × ep ranks, each with a contiguous slice of every
micro-batch): the load-balancing statistics are summed over the group in the forward pass, and
gradients are summed after backward — dense ones over the whole group, expert ones over the ranks
that hold the same experts."""

from __future__ import annotations

import torch

from moemesh.models.moe import RouterStats
from moemesh.models.transformer import MoECausalLM, shift_labels
from moemesh.parallel import comm
from moemesh.parallel.expert import is_expert_parameter
from moemesh.parallel.mesh import Mesh


def apply_data_parallel(model: MoECausalLM, mesh: Mesh) -> MoECausalLM:
    group, ranks = mesh.group("batch"), mesh.dims.batch_size
    if group is None:
        return model

    def reduce_router_stats(stats: list[RouterStats]) -> list[RouterStats]:
        layers = len(stats)
        summed = comm.all_reduce_sum(torch.cat([torch.stack([s.counts for s in stats]),
                                                torch.stack([s.prob_sum for s in stats])]), group)
        # every rank holds an equal slice, so the micro-batch has ranks × the local tokens
        return [RouterStats(summed[i], summed[layers + i], s.num_tokens * ranks) for i, s in enumerate(stats)]

    model.reduce_router_stats = reduce_router_stats
    return model


def reduce_gradients(model: MoECausalLM, mesh: Mesh) -> None:
    """Sum every gradient over the ranks that computed a share of it."""
    dense, experts = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            (experts if is_expert_parameter(name) else dense).append(param.grad)
    comm.all_reduce_sum_(dense, mesh.group("batch"), kind="grad_all_reduce")
    comm.all_reduce_sum_(experts, mesh.group("dp"), kind="grad_all_reduce")


def label_tokens(labels: torch.Tensor) -> int:
    """How many positions of `labels` have a next token to predict."""
    return int((shift_labels(labels) != -100).sum())


def rank_loss(ce_loss: torch.Tensor, aux_loss: torch.Tensor | None, local_label_tokens: int,
              micro_batch_label_tokens: int, aux_coef: float, ranks: int) -> torch.Tensor:
    """This rank's share of the micro-batch loss. Summed over the batch group it is the loss one
    process computes on the whole micro-batch: the cross-entropy is weighted by this rank's share
    of the labelled tokens, and the aux loss (identical on every rank, from summed statistics) is
    split evenly."""
    loss = ce_loss * (local_label_tokens / max(micro_batch_label_tokens, 1))
    if aux_loss is not None:
        loss = loss + aux_coef * aux_loss / ranks
    return loss


def clip_grad_norm_(model: MoECausalLM, max_norm: float, mesh: Mesh) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm (as
    torch.nn.utils.clip_grad_norm_ does); returns the norm before clipping. Call after
    `reduce_gradients`: a gradient is then the same on every rank that holds the same part of its
    parameter, so each part counts once: squared norms of expert shards are summed over ep, those
    of TP shards over tp, and replicated ones (identical on every TP rank) are taken as they are."""
    zero = torch.zeros((), device=next(model.parameters()).device, dtype=torch.float32)
    squares = {(over_ep, over_tp): zero.clone() for over_ep in (False, True) for over_tp in (False, True)}
    grads = []
    for name, param in model.named_parameters():
        if param.grad is not None:
            squares[is_expert_parameter(name), hasattr(param, "tp_dim")] += param.grad.float().pow(2).sum()
            grads.append(param.grad)
    comm.all_reduce_sum_([squares[True, False], squares[True, True]], mesh.group("ep"), kind="grad_norm")
    comm.all_reduce_sum_([squares[False, True], squares[True, True]], mesh.group("tp"), kind="grad_norm")
    total = sum(squares.values()).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale)
    return total
