"""Data parallelism over the "batch" group (dp_replicate × dp_shard × ep ranks, each with a
contiguous slice of every micro-batch): the load-balancing statistics are summed over the group in
the forward pass, and gradients are summed after backward — dense ones over the whole group,
expert ones over the ranks that hold the same experts. Parameters that FSDP shards
(`parallel/fsdp.py`) have their gradients reduce-scattered by FSDP during backward instead."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import DTensor

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
        summed = comm.all_reduce_sum(
            torch.cat([torch.stack([s.counts for s in stats]), torch.stack([s.prob_sum for s in stats])]), group
        )
        # every rank holds an equal slice, so the micro-batch has ranks × the local tokens
        return [RouterStats(summed[i], summed[layers + i], s.num_tokens * ranks) for i, s in enumerate(stats)]

    model.reduce_router_stats = reduce_router_stats
    return model


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a tensor: the local shard of an FSDP DTensor (sharing its storage, so
    writing into it writes into the DTensor), a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_fsdp_sharded(param: torch.Tensor) -> bool:
    return isinstance(param, DTensor)


def reduce_gradients(model: MoECausalLM, mesh: Mesh) -> None:
    """Sum every gradient over the ranks that computed a share of it: those FSDP did not already
    reduce over the data-parallel ranks, the partial ones (q/k norms under TP) over tp, and those of
    a key/value head that several tp ranks hold (`tp_copies`, parallel/tensor.py) over these ranks."""
    dense, experts, partial_over_tp, copied = [], [], [], {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = local(param.grad)
        if not is_fsdp_sharded(param):
            (experts if is_expert_parameter(name) else dense).append(grad)
        if getattr(param, "partial_grad_axis", None) == "tp":
            partial_over_tp.append(grad)
        if (copies := getattr(param, "tp_copies", 1)) > 1:
            copied.setdefault(copies, []).append(grad)
    comm.all_reduce_sum_(dense, mesh.group("batch"), kind="grad_all_reduce")
    for axis in ("dp_replicate", "dp_shard"):  # the ranks holding the same experts
        comm.all_reduce_sum_(experts, mesh.group(axis), kind="grad_all_reduce")
    comm.all_reduce_sum_(partial_over_tp, mesh.group("tp"), kind="grad_all_reduce")
    for copies, grads in sorted(copied.items()):
        comm.all_reduce_sum_(grads, mesh.tp_copies(copies)["tp_copies"].get_group(), kind="grad_all_reduce")


def label_tokens(labels: torch.Tensor) -> int:
    """How many positions of `labels` have a next token to predict."""
    return int((shift_labels(labels) != -100).sum())


def rank_loss(
    ce_loss: torch.Tensor,
    aux_loss: torch.Tensor | None,
    local_label_tokens: int,
    micro_batch_label_tokens: int,
    aux_coef: float,
    ranks: int,
) -> torch.Tensor:
    """This rank's share of the micro-batch loss. Summed over the batch group it is the loss one
    process computes on the whole micro-batch: the cross-entropy is weighted by this rank's share
    of the labelled tokens, and the aux loss (identical on every rank, from summed statistics) is
    split evenly."""
    loss = ce_loss * (local_label_tokens / max(micro_batch_label_tokens, 1))
    if aux_loss is not None:
        loss = loss + aux_coef * aux_loss / ranks
    return loss


NORM_AXES = ("pp", "dp_shard", "ep", "tp")  # the axes over which ranks can hold different parts


def split_axes(name: str, param: torch.Tensor, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes over which the ranks hold different parts of `param` (and of its gradient);
    along the other axes they hold the same part."""
    expert = is_expert_parameter(name)
    axes = {"pp"}  # pipeline ranks hold different layers (a no-op without a pipeline)
    if is_fsdp_sharded(param):
        axes |= {"dp_shard"} if expert else {"dp_shard", "ep"}
    if expert:
        axes.add("ep")
    if hasattr(param, "tp_dim"):
        axes.add("tp")
    return tuple(axis for axis in NORM_AXES if axis in axes)


def clip_grad_norm_(model: MoECausalLM, max_norm: float, mesh: Mesh) -> torch.Tensor:
    """Scale all gradients so their global L2 norm is at most max_norm (as
    torch.nn.utils.clip_grad_norm_ does); returns the norm before clipping. Call after
    `reduce_gradients`: a gradient is then the same on every rank that holds the same part of its
    parameter, so each part counts once: the squared norms of the parts are summed over the axes
    that split them (`split_axes`) and not over the others."""
    grads = [(name, param, local(param.grad)) for name, param in model.named_parameters() if param.grad is not None]
    device = grads[0][2].device if grads else None
    # One squared norm per combination of axes, every combination on every rank, in one order: a
    # pipeline rank may hold no parameter of some kind, and the sums over an axis must line up.
    combinations = [
        tuple(a for a, keep in zip(NORM_AXES, bits) if keep)
        for bits in itertools.product((False, True), repeat=len(NORM_AXES))
    ]
    by_axes = {axes: [] for axes in combinations}
    for name, param, grad in grads:
        if mesh.rank("tp") % getattr(param, "tp_copies", 1) == 0:  # a key/value head copied on tp ranks: once
            by_axes[split_axes(name, param, mesh)].append(grad)
    # One multi-tensor kernel per kind, accumulating in fp32 without an fp32 copy of a bf16 gradient.
    squares = {
        axes: torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum()
        if group
        else torch.zeros((), device=device)
        for axes, group in by_axes.items()
    }
    for axis in NORM_AXES:  # a sum over several axes is a sum over each in turn
        comm.all_reduce_sum_([s for axes, s in squares.items() if axis in axes], mesh.group(axis), kind="grad_norm")
    total = sum(squares.values()).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    if grads:
        torch._foreach_mul_([grad for _, _, grad in grads], scale)
    return total
