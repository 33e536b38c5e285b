"""Expert parallelism: each rank of the ep group holds E/ep experts, and tokens travel to them
by all-to-all.

A token is sent once to every rank that holds at least one of its k experts, together with the
local ids and routing weights of those experts; the receiving rank expands it to one copy per
expert, runs its experts, and sends back one row per token: the weighted sum of its experts'
outputs. So routing-weight gradients are computed where the expert outputs are, and travel back
with the token gradients.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from moemesh.errors import ConfigError
from moemesh.models.moe import Dispatched, MoEBlock, Routing
from moemesh.models.transformer import MoECausalLM
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh


class AllToAllDispatcher:
    def __init__(self, group, ep_size: int, num_local_experts: int):
        self.group = group
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        num_tokens, top_k = routing.expert_ids.shape
        local = self.num_local_experts
        dest = routing.expert_ids // local  # [T, k] rank holding each chosen expert
        goes_to = torch.zeros(num_tokens, self.ep_size, dtype=torch.bool, device=x.device)
        goes_to.scatter_(1, dest, True)
        # One row per (rank, token) pair, ordered by rank and then token.
        row_rank, row_token = goes_to.T.nonzero(as_tuple=True)
        on_rank = dest[row_token] == row_rank[:, None]  # [rows, k]: which slots this row serves
        local_ids = torch.where(on_rank, routing.expert_ids[row_token] % local, local)  # `local` = not here
        weights = torch.where(on_rank, routing.weights[row_token], 0.0)

        # per rank: rows it gets, and expert slots those rows expand to
        sizes = torch.stack([goes_to.sum(0), torch.bincount(dest.flatten(), minlength=self.ep_size)], dim=1)
        incoming = comm.exchange_sizes(sizes, self.group)
        send_splits, recv_splits = sizes[:, 0].tolist(), incoming[:, 0].tolist()
        x_in, weights_in, ids_in = comm.all_to_all([x[row_token], weights, local_ids], recv_splits, send_splits,
                                                   self.group)

        flat_ids = ids_in.flatten()
        order = torch.argsort(flat_ids, stable=True)[: int(incoming[:, 1].sum())]  # drop slots served elsewhere
        slot_row = order // top_k
        group_sizes = torch.bincount(flat_ids, minlength=local + 1)[:local]
        state = (row_token, send_splits, recv_splits, order, slot_row, weights_in)
        return Dispatched(x_in[slot_row], group_sizes, state)

    def combine(self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing,
                num_tokens: int) -> torch.Tensor:
        row_token, send_splits, recv_splits, order, slot_row, weights_in = dispatched.state
        weighted = expert_out.float() * weights_in.flatten()[order, None]
        rows = weighted.new_zeros(sum(recv_splits), expert_out.shape[-1]).index_add_(0, slot_row, weighted)
        (back,) = comm.all_to_all([rows.to(expert_out.dtype)], send_splits, recv_splits, self.group)
        out = back.new_zeros(num_tokens, back.shape[-1], dtype=torch.float32)
        return out.index_add_(0, row_token, back.float()).to(expert_out.dtype)


def apply_ep(model: MoECausalLM, mesh: Mesh) -> MoECausalLM:
    """Keep this rank's E/ep experts of every MoE layer and install the all-to-all dispatcher.
    Call on the full, identically initialised model of every rank."""
    ep, rank = mesh.dims.ep, mesh.rank("ep")
    if ep == 1:
        return model
    num_experts = model.config.num_experts
    if num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide num_experts={num_experts}")
    local = num_experts // ep
    for block in model.modules():
        if isinstance(block, MoEBlock):
            for name in ("gate_up_proj", "down_proj"):
                full = getattr(block.experts, name)
                setattr(block.experts, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))
            block.dispatcher = AllToAllDispatcher(mesh.group("ep"), ep, local)
    return model


def is_expert_parameter(name: str) -> bool:
    return ".mlp.experts." in name


def expert_state_as_dtensors(state: dict, mesh: Mesh) -> dict:
    """In a model/optimizer state dict, wrap this rank's expert shards (weights and their AdamW
    moments) as DTensors sharded over ep: torch.distributed.checkpoint then saves every shard under
    its place in the full tensor, and loads into any other ep size."""
    if mesh.dims.ep == 1:
        return state
    ep_mesh = mesh.device_mesh["ep"]

    def wrap(name: str, value):
        if isinstance(value, dict):
            return {k: wrap(k if is_expert_parameter(k) else name, v) for k, v in value.items()}
        if isinstance(value, torch.Tensor) and value.dim() > 0 and is_expert_parameter(name):
            return DTensor.from_local(value, ep_mesh, [Shard(0)], run_check=False)
        return value

    return wrap("", state)
