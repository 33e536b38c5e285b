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

from moemesh.errors import ConfigError
from moemesh.models.moe import Dispatched, MoEBlock, Routing
from moemesh.models.transformer import MoECausalLM
from moemesh.ops import combine, permute
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pieces import record_piece


class AllToAllDispatcher:
    local = False  # experts live on other ranks too: the MoE block always dispatches

    def __init__(self, group, ep_size: int, num_local_experts: int):
        self.group = group
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        num_tokens = x.shape[0]
        local = self.num_local_experts
        dest = routing.expert_ids // local  # [T, k] rank holding each chosen expert
        goes_to = torch.zeros(num_tokens, self.ep_size, dtype=torch.bool, device=x.device)
        goes_to.scatter_(1, dest, True)
        # Per destination rank: the rows (tokens) it gets and the expert slots they carry. Each
        # rank learns what it receives; one host copy of both is the layer's only device sync.
        slots = torch.zeros(self.ep_size, dtype=torch.long, device=x.device)
        slots.index_add_(0, dest.flatten(), torch.ones_like(dest.flatten()))
        sending = torch.stack([goes_to.sum(0), slots], dim=1)  # [ep, 2]
        host = torch.cat([sending, comm.exchange_sizes(sending, self.group)]).tolist()
        send_splits = [rows for rows, _ in host[: self.ep_size]]
        recv_splits = [rows for rows, _ in host[self.ep_size :]]
        real = sum(slots for _, slots in host[self.ep_size :])  # expert rows to compute here
        # One row per (rank, token) pair, ordered by rank and then token: the set entries of
        # goes_to.T, found by a stable sort (their number is known, so no sync as nonzero has).
        pairs = torch.argsort((~goes_to.T).flatten().to(torch.uint8), stable=True)[: sum(send_splits)]
        row_rank, row_token = pairs // num_tokens, pairs % num_tokens
        on_rank = dest[row_token] == row_rank[:, None]  # [rows, k]: which slots this row serves
        local_ids = torch.where(on_rank, routing.expert_ids[row_token] % local, local)  # `local`: not here
        weights = torch.where(on_rank, routing.weights[row_token], 0.0)

        x_in, weights_in, ids_in = comm.all_to_all(
            [x[row_token], weights, local_ids], recv_splits, send_splits, self.group
        )
        # Expand each received row to its experts here; slots served elsewhere form a last group
        # that no expert computes, and that the combine skips (-1).
        permuted = permute(x_in, ids_in, local + 1)
        position = torch.where(ids_in == local, -1, permuted.position)
        # Where each returning row goes: source[t, p] is the row of (rank p, token t), or -1.
        source = torch.full((num_tokens, self.ep_size), -1, dtype=torch.long, device=x.device)
        source[row_token, row_rank] = torch.arange(len(row_token), device=x.device)
        state = (position, weights_in, source, send_splits, recv_splits)
        return Dispatched(permuted.grouped[:real], permuted.offsets.diff()[:local], state)

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        position, weights_in, source, send_splits, recv_splits = dispatched.state
        rows = combine(expert_out, position, weights_in, skip=True)  # per row: Σ weight · expert output
        (back,) = comm.all_to_all([rows], send_splits, recv_splits, self.group)
        ones = torch.ones(source.shape, device=back.device)
        return combine(back, source, ones, skip=True)  # per token: Σ over the ranks it visited


def apply_ep(model: MoECausalLM, mesh: Mesh) -> MoECausalLM:
    """Keep this rank's E/ep experts of every MoE layer and install the all-to-all dispatcher.
    Call on the whole model, on the meta device (`parallelize`) or identically initialised."""
    ep, rank = mesh.dims.ep, mesh.rank("ep")
    if ep == 1:
        return model
    num_experts = model.config.num_experts
    if num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} must divide num_experts={num_experts}")
    local = num_experts // ep
    mine = torch.arange(rank * local, (rank + 1) * local)
    for block in model.modules():
        if isinstance(block, MoEBlock):
            # Every parameter of the bank is per expert on dim 0 (matrices, biases).
            for name, full in list(block.experts.named_parameters(recurse=False)):
                kept = full.detach()[rank * local : (rank + 1) * local].clone()
                kept = nn.Parameter(kept, requires_grad=full.requires_grad)  # a frozen base stays frozen
                setattr(block.experts, name, record_piece(kept, full, 0, mine))
            block.dispatcher = AllToAllDispatcher(mesh.group("ep"), ep, local)
    return model


def is_expert_parameter(name: str) -> bool:
    return ".mlp.experts." in name
