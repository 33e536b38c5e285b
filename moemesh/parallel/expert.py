"""Expert parallelism: each rank of the ep group holds E/ep experts, and tokens travel to them.

Two dispatchers (`parallel.ep_dispatch`):

`GatherDispatcher` (the default) never waits for the host. Every rank gathers the tokens of all ep
ranks with their routing (one all-gather of T rows a rank: at top-8 of 128 experts on 4 ranks a
token has an expert on ~90% of the ranks, so this sends ~10% more than exact splits would), expands
the (token, slot) pairs whose expert it holds into a buffer sorted by local expert, runs its
experts, sums each gathered token's weighted expert outputs, and sends the sums back (an
all-to-all of equal blocks, added up in fp32 on the token's rank). Every shape is known before the
routing is, so the host queues layer after layer ahead of the GPU. The price: the buffer's rows
must be fixed before the routing says how many pairs land here. Its capacity is
`capacity_factor` × the mean (T·k rows); pairs past it are dropped and the largest need is
recorded, so that `fit_capacity` — called by the trainer after each forward, before its backward
(one host sync) — can say it overflowed: it then raises the factor and the trainer runs that
forward again, so no token is ever dropped from a forward whose gradients count. Without a
factor the buffer holds every possible pair (ep · min(k, E/ep) · T rows: exact whatever the
routing, at several times the activation memory).
All ranks of the group must dispatch the same number of tokens (the trainer's equal slices).
On four H200s (docs/benchmarks.md, 2026-11-27) it is 5–7% faster than exact splits; both are bound
by the router's balance: when one rank gets 2–3× the mean pairs of a layer, as a random router on
byte-level text does, the others wait for it, and fully sharded data parallelism is twice as fast.

`AllToAllDispatcher` sends a token once to every rank that holds at least one of its k experts,
with exact split sizes: the sizes are exchanged and copied to the host once per MoE layer, which
makes the CPU wait for the GPU there.

Both compute routing-weight gradients where the expert outputs are, and send them back with the
token gradients.

`ReplicatedTokensDispatcher` is expert parallelism for decoding (`apply_ep_for_decoding`): every
rank holds the same tokens — attention, embedding and head replicated — computes its experts' share
of each, and the block's one all-reduce adds the shares. No token travels and the host never
waits, at the price of attention computed on every rank (and its KV cache held on every rank).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from moemesh.errors import ConfigError
from moemesh.models.moe import Dispatched, MoEBlock, Routing
from moemesh.models.transformer import MoECausalLM
from moemesh.ops import combine, permute
from moemesh.ops.permute import permute_rows, routing_layout
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pieces import record_piece

DISPATCHERS = ("gather", "all_to_all")
# What `fit_capacity` gives a layer whose buffer was full: this × the largest need it saw.
HEADROOM = 1.2


class GatherDispatcher:
    local = False  # experts live on other ranks too: the MoE block always dispatches

    def __init__(self, group, ep_size: int, rank: int, num_local_experts: int):
        self.group = group
        self.ep_size, self.rank = ep_size, rank
        self.num_local_experts = num_local_experts
        self.capacity_factor: float | None = None  # None: room for every possible pair
        # Since the last `fit_capacity`: the largest rows / (T·k) a dispatch needed, and the most
        # pairs it dropped (fp32 device scalars, read and zeroed there).
        self.needed: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None

    def capacity(self, num_tokens: int, top_k: int) -> int:
        """Rows of the expert buffer for `num_tokens` tokens a rank."""
        most = self.ep_size * num_tokens * min(top_k, self.num_local_experts)
        if self.capacity_factor is None:
            return most
        return min(most, math.ceil(self.capacity_factor * num_tokens * top_k))

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        num_tokens, top_k = routing.expert_ids.shape
        local = self.num_local_experts
        ids = routing.expert_ids.to(torch.int32)
        x_all, weights_all, ids_all = comm.all_gather_rows([x, routing.weights, ids], self.group)
        here = ids_all // local == self.rank
        local_ids = torch.where(here, ids_all % local, local)  # `local`: served by another rank
        # Sorted by local expert, the other ranks' pairs last; starts[local]: the pairs here.
        position, _, starts, _ = routing_layout(x_all, local_ids, local + 1, 1)
        rows = self.capacity(num_tokens, top_k)
        if num_tokens:
            need, dropped = starts[local].float() / (num_tokens * top_k), (starts[local] - rows).clamp(min=0).float()
            if self.needed is None:
                self.needed, self.dropped = need, dropped
            else:  # in place: a step captured as a CUDA graph updates the tensors it was captured with
                torch.maximum(self.needed, need, out=self.needed)
                torch.maximum(self.dropped, dropped, out=self.dropped)
        # Pairs served elsewhere, and any past the capacity, read no row (-1).
        position = torch.where(position < starts[local].clamp(max=rows), position, -1)
        grouped = permute_rows(x_all, position, rows)
        group_sizes = starts[: local + 1].clamp(max=rows).diff()
        return Dispatched(grouped, group_sizes, (position, weights_all))

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        position, weights_all = dispatched.state
        sums = combine(expert_out, position, weights_all, skip=True)  # per gathered token: Σ weight · expert output
        return comm.reduce_scatter_rows(sums, self.group)  # per token: Σ over the ranks


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


def apply_ep(model: MoECausalLM, mesh: Mesh, dispatch: str = "gather") -> MoECausalLM:
    """Keep this rank's E/ep experts of every MoE layer and install the `dispatch` dispatcher
    (`DISPATCHERS`). Call on the whole model, on the meta device (`parallelize`) or identically
    initialised."""
    ep, rank = mesh.dims.ep, mesh.rank("ep")
    if dispatch not in DISPATCHERS:
        raise ConfigError(f"parallel.ep_dispatch must be one of {', '.join(DISPATCHERS)}, got {dispatch!r}")
    if ep == 1:
        return model
    local = keep_experts(model, ep, rank, "parallel.ep")
    for block in model.modules():
        if isinstance(block, MoEBlock):
            if dispatch == "gather":
                block.dispatcher = GatherDispatcher(mesh.group("ep"), ep, rank, local)
            else:
                block.dispatcher = AllToAllDispatcher(mesh.group("ep"), ep, local)
    return model


def keep_experts(model: MoECausalLM, ranks: int, rank: int, what: str) -> int:
    """Keep experts rank·E/ranks .. (rank + 1)·E/ranks - 1 of every MoE layer (each piece recorded
    for reading a checkpoint per rank); -> E/ranks."""
    num_experts = model.config.num_experts
    if num_experts % ranks:
        raise ConfigError(f"{what}={ranks} must divide num_experts={num_experts}")
    local = num_experts // ranks
    mine = torch.arange(rank * local, (rank + 1) * local)
    for block in model.modules():
        if isinstance(block, MoEBlock):
            # Every parameter of the bank is per expert on dim 0 (matrices, biases).
            for name, full in list(block.experts.named_parameters(recurse=False)):
                kept = full.detach()[rank * local : (rank + 1) * local].clone()
                kept = nn.Parameter(kept, requires_grad=full.requires_grad)  # a frozen base stays frozen
                setattr(block.experts, name, record_piece(kept, full, 0, mine))
    return local


class ReplicatedTokensDispatcher:
    """Every rank holds the same tokens: each computes the (token, expert) pairs of its own
    experts, and the block's `reduce_output` sums the ranks' shares. Each pair is computed on
    exactly one rank, so the sum is one process's in another order. A decode step's few pairs
    skip the dispatch: the block's selected-experts path reads this rank's experts for the pairs
    that chose them (`first_expert`)."""

    local = False  # experts live on other ranks too: the MoE block dispatches, or selects its own

    def __init__(self, rank: int, num_local_experts: int):
        self.rank, self.num_local_experts = rank, num_local_experts
        self.first_expert = rank * num_local_experts  # the global id of local expert 0

    def dispatch(self, x: torch.Tensor, routing: Routing, num_experts: int) -> Dispatched:
        local = self.num_local_experts
        here = routing.expert_ids // local == self.rank
        # The other ranks' pairs in a last group that no expert computes and the combine skips.
        permuted = permute(x, torch.where(here, routing.expert_ids % local, local), local + 1)
        return Dispatched(permuted.grouped, permuted.offsets.diff()[:local], torch.where(here, permuted.position, -1))

    def combine(
        self, expert_out: torch.Tensor, dispatched: Dispatched, routing: Routing, num_tokens: int
    ) -> torch.Tensor:
        return combine(expert_out, dispatched.state, routing.weights, skip=True)  # this rank's share


def apply_ep_for_decoding(model: MoECausalLM, mesh: Mesh) -> MoECausalLM:
    """Expert parallelism for an engine: this rank's E/ep experts of every MoE layer, everything
    else replicated, the tokens too (`share_experts`; one all-reduce a MoE layer)."""
    if mesh.dims.ep > 1:
        share_experts(model, mesh.dims.ep, mesh.rank("ep"), mesh.group("ep"), "parallel.ep")
    return model


def share_experts(model: MoECausalLM, ranks: int, rank: int, group, what: str) -> None:
    """Every rank of `group` holds the same tokens: this one keeps E/ranks whole experts of every
    MoE layer (`keep_experts`), computes their share of each token (`ReplicatedTokensDispatcher`),
    and the block's one all-reduce over `group` adds the shares. Refuses DeepSeek's shared experts,
    which every rank would add to its share (`what`: the size's name in the errors)."""
    blocks = [block for block in model.modules() if isinstance(block, MoEBlock)]
    if any(block.shared_experts is not None for block in blocks):
        raise ConfigError(
            f"{what}={ranks} with whole experts a rank does not support shared experts yet: use tensor parallelism "
            "alone (each expert's rows split)"
        )
    local = keep_experts(model, ranks, rank, what)
    for block in blocks:
        block.dispatcher = ReplicatedTokensDispatcher(rank, local)
        block.reduce_output = functools.partial(comm.from_partial, group=group)


def _gather_dispatchers(model: nn.Module) -> dict[int, GatherDispatcher]:
    """The gathering dispatchers of the decoder layers this rank holds, by layer index (under
    tensor parallelism inside its wrapper)."""
    found = {}
    for i, layer in enumerate(model.model.layers):
        dispatcher = getattr(getattr(layer, "mlp", None), "dispatcher", None)
        dispatcher = getattr(dispatcher, "inner", dispatcher)  # tensor parallelism's wrapper
        if isinstance(dispatcher, GatherDispatcher):
            found[i] = dispatcher
    return found


def start_capacity(model: MoECausalLM, factor: float) -> None:
    """Give every gathering dispatcher a buffer of `factor` × the mean rows (see the module doc)."""
    for dispatcher in _gather_dispatchers(model).values():
        dispatcher.capacity_factor = factor


def fit_capacity(model: MoECausalLM, group) -> list[str]:
    """After a forward (a pipeline's step, an evaluation): each MoE layer's largest need since
    the last call, over every rank of `group` (the whole world: a pipeline rank holds only some
    layers), in one host sync. A layer whose need passed its capacity raises it to HEADROOM × the
    need, on every rank that holds it, and is named in the returned lines, the same on every rank;
    none returned: nothing was dropped. Every rank of `group` must call it, whatever layers it
    holds."""
    held = _gather_dispatchers(model)
    device = next(model.parameters()).device
    needs = torch.zeros(2, model.config.num_hidden_layers, device=device)  # per layer: the need, pairs dropped
    for i, dispatcher in held.items():
        if dispatcher.needed is not None:
            needs[0, i], needs[1, i] = dispatcher.needed, dispatcher.dropped
            dispatcher.needed.zero_()  # in place (see `dispatch`): 0 is below any need
            dispatcher.dropped.zero_()
    if group is not None:
        needs = comm.all_reduce_max(needs, group)
    overflowed = []
    for i, (need, dropped) in enumerate(zip(*needs.tolist())):
        if dropped:
            raised = math.ceil(round(HEADROOM * need * 100, 6)) / 100  # in hundredths, up
            if i in held:
                held[i].capacity_factor = raised
            overflowed.append(f"layer {i} needed {need:.2f}× the mean expert rows, past its room; now {raised:.2f}×")
    return overflowed


def is_expert_parameter(name: str) -> bool:
    return ".mlp.experts." in name
