"""Runs this rank's operations of a pipeline schedule (`schedule.py`) for one optimizer step.

A forward of (stage s, micro-batch m) takes the token ids (first stage) or the hidden states that
stage s-1 sent, runs the stage's layers and sends the result on to stage s+1 — a local hand-off when
this rank holds s+1 too, as DualPipeV's middle stages are. Its backward takes the gradient that
stage s+1 sent back and sends the input's gradient to stage s-1; the stage's saved tensors are freed
as soon as its backward is done. A backward the schedule marks `defer_weight` leaves its weight
GEMMs to a later W operation (`ops/weight_grad.py`). Sends do not wait, receives do, and a rank
takes a peer's messages in the order the peer sent them (`schedule.messages`), keeping those that
come early for their operation; with a valid schedule nothing can deadlock. Each direction between
two ranks has its own process group, so that NCCL never queues a receive behind a waiting send.

The load-balancing loss pools token counts and router probabilities over all MoE layers of the
model, which live on different stages. Its value is Σ_e C_e·P_e·E/N² (C: token counts, P: summed
probabilities, N: tokens × MoE layers), linear in P once C is known: the forward messages carry the
counts accumulated so far, the last stage gets the whole C, and the backward messages bring C back
so that each stage adds the gradient of its own share Σ_e C_e·P_stage,e·E/N².

A rank's loss is its share of the micro-batch loss (`rank_loss`) / the number of micro-batches, as
without a pipeline, so the gradients after a step are those of one process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from moemesh.models.transformer import MoECausalLM
from moemesh.ops.weight_grad import WeightGradStore
from moemesh.parallel import comm
from moemesh.parallel.data import rank_loss
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pipeline.schedule import Schedule, messages
from moemesh.parallel.pipeline.stage import RankStages, Stage, cut_model


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # this rank's slice, on the device: input ids and labels alike
    local_label_tokens: int  # labelled positions in the slice
    label_tokens: int  # ... in the whole micro-batch (all data-parallel ranks)


@dataclass
class _Saved:
    inputs: torch.Tensor | None  # the received hidden states (a leaf whose gradient goes back)
    output: torch.Tensor  # hidden states sent on, or the last stage's scaled loss
    prob_sums: torch.Tensor | None  # [layers, E]: the stage's MoE layers' summed router probabilities
    num_tokens: int  # tokens per MoE layer in the micro-batch (all data-parallel ranks)


class PipelineRunner:
    def __init__(self, model: MoECausalLM, mesh: Mesh, schedule: Schedule, ranges: list[range],
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.schedule, self.autocast = model, schedule, autocast
        self.group = mesh.group("pp")
        self.rank = mesh.rank("pp")
        self.links = _directed_links(mesh)
        self.data_ranks = mesh.dims.batch_size
        self.stages: dict[int, Stage] = cut_model(model, ranges, list(schedule.stage_rank), self.rank)
        self.module = RankStages(model, self.stages)  # the root FSDP shards, when it does (`use_fsdp`)
        self.fsdp = False
        config = model.config
        self.num_experts = max(config.num_experts, 1)
        self.moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        self.aux = config.output_router_logits  # train the load-balancing loss
        self.aux_coef = config.router_aux_loss_coef
        self.weight_grads = WeightGradStore()
        self.op_times: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        # What each peer sends this rank, in its order (training; evaluation goes stage by stage).
        self.expected = {src: sent for (src, dst), (sent, _) in messages(schedule).items() if dst == self.rank}
        self.device = next(model.parameters()).device

    def use_fsdp(self) -> None:
        """The model is sharded by FSDP (`apply_fsdp` with `root=self.module`): reduce-scatter each
        block's gradients once per step, in the backward of its stage's last micro-batch (FSDP
        accumulates them unsharded before), and the root's in this rank's last backward. Weight
        gradients are then not deferred: FSDP reduces a block's gradients when its backward ends."""
        self.fsdp = True
        backwards = [(j, op.stage if op.kind == "B" else op.b_stage)
                     for j, op in enumerate(self.schedule.ops[self.rank]) if op.kind in ("B", "FB")]
        self.last_backward = {stage: j for j, stage in backwards}
        self.final_backward = backwards[-1][0]

    def _set_gradient_sync(self, s: int, op_index: int) -> None:
        for i in self.stages[s].layers:
            self.model.model.layers[i].set_requires_gradient_sync(op_index == self.last_backward[s])
        self.module.set_requires_gradient_sync(op_index == self.final_backward, recurse=False)

    def _peer(self, stage: int) -> tuple[int, dist.ProcessGroup]:
        """The global rank holding `stage`, and the group of messages from this rank to it."""
        peer = self.schedule.stage_rank[stage]
        return dist.get_global_rank(self.group, peer), self.links[(self.rank, peer)]

    # ---- messages --------------------------------------------------------------------------------
    # A message is ("act", from_stage, micro) or ("grad", from_stage, micro), as `messages` names them.
    def _post(self, key: tuple[str, int, int], to_stage: int, tensors: list[torch.Tensor]) -> None:
        if to_stage in self.stages:  # a hand-off between two stages of this rank
            self.inbox[key] = tensors
        else:
            # Drop the sends that are done: their buffers (activations, gradients) can go.
            self.pending = [(work, sent) for work, sent in self.pending if not work.is_completed()]
            self.pending += comm.send(tensors, *self._peer(to_stage))

    def _take(self, key: tuple[str, int, int], hidden_shape) -> list[torch.Tensor]:
        """The message `key`. A peer may send a message this rank needs later before the one it
        needs now (DualPipeV with pp > 2 does): messages from a peer are received in the order
        it sends them, and those that come early wait in the inbox."""
        from_stage = key[1]
        if key in self.inbox or from_stage in self.stages:
            return self.inbox.pop(key)
        peer = self.schedule.stage_rank[from_stage]
        source, _ = self._peer(from_stage)
        link = self.links[(peer, self.rank)]
        shapes = [(hidden_shape, torch.float32), ((self.num_experts,), torch.float32)]
        if not self.training:  # stage by stage, micro-batch by micro-batch: both sides in one order
            return comm.recv(shapes, source, link, self.device)
        while True:
            arrived = self.expected[peer][self.received[peer]]
            self.received[peer] += 1
            tensors = comm.recv(shapes, source, link, self.device)
            if arrived == key:
                return tensors
            self.inbox[arrived] = tensors

    # ---- one stage, one micro-batch -------------------------------------------------------------
    def _forward(self, s: int, m: int, train: bool) -> None:
        stage, micro = self.stages[s], self.micro[m]
        tokens = micro.tokens
        hidden_shape = (*tokens.shape, self.model.config.hidden_size)
        if stage.first:
            x, counts = tokens, torch.zeros(self.num_experts, device=self.device)
        else:
            x, counts = self._take(("act", s - 1, m), hidden_shape)
            x.requires_grad_(train)
        positions = torch.arange(tokens.shape[1], device=self.device)
        with self._busy(), self.autocast():
            out, layer_counts, prob_sums, num_tokens = self.module(s, x, positions, tokens, reduce_stats=train)
            if layer_counts is not None:
                counts = counts + layer_counts.sum(0).float()
            if stage.last:
                self.ce[m] = out.detach().float()
                self.total_counts[m] = counts
                output = rank_loss(out, None, micro.local_label_tokens, micro.label_tokens, 0.0,
                                   self.data_ranks) / len(self.micro)
            else:
                output = out
                self._post(("act", s, m), s + 1, [out.detach().float(), counts])
        if train:
            self.saved[(s, m)] = _Saved(x if not stage.first else None, output, prob_sums, num_tokens)

    def _backward(self, s: int, m: int, defer_weight: bool, op_index: int) -> None:
        stage, saved = self.stages[s], self.saved.pop((s, m))  # freed once this backward is done
        if self.fsdp:
            self._set_gradient_sync(s, op_index)
            defer_weight = False
        hidden_shape = (*self.micro[m].tokens.shape, self.model.config.hidden_size)
        if stage.last:
            counts, outputs, grads = self.total_counts.pop(m), [saved.output], [None]
        else:
            grad, counts = self._take(("grad", s + 1, m), hidden_shape)
            outputs, grads = [saved.output], [grad.to(saved.output.dtype)]
        with self._busy():
            if saved.prob_sums is not None and self.aux:
                share = self._aux_share(saved, counts)
                self.aux_sum += share.detach() / len(self.micro)
                outputs.append(self.aux_coef * share / self.data_ranks / len(self.micro))
                grads.append(None)
            with self.weight_grads.deferring(defer_weight):
                torch.autograd.backward(outputs, grads)
        if not stage.first:
            self._post(("grad", s, m), s - 1, [saved.inputs.grad, counts])

    @contextlib.contextmanager
    def _busy(self):
        """When `op_times` is a list (a benchmark sets it), CUDA events around the compute of each
        operation, after its inputs arrived: their total against the step time is the bubble."""
        if self.op_times is None or self.device.type != "cuda":
            yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.op_times.append((start, end))

    def _aux_share(self, saved: _Saved, counts: torch.Tensor) -> torch.Tensor:
        """This stage's part of the load-balancing loss, given all layers' token counts."""
        pooled = float(saved.num_tokens * self.moe_layers)
        prob_sum = saved.prob_sums.sum(0).float()
        return self.num_experts * torch.sum(counts / pooled * prob_sum / pooled)

    # ---- a step -----------------------------------------------------------------------------------
    def _reset(self, micro_batches: list[MicroBatch], training: bool) -> None:
        self.micro, self.training = micro_batches, training
        self.inbox, self.saved, self.total_counts, self.pending = {}, {}, {}, []
        self.received = {peer: 0 for peer in self.expected}  # messages taken from each peer so far
        self.ce: dict[int, torch.Tensor] = {}  # the last stage's cross-entropy of each micro-batch (slice)
        self.aux_sum = torch.zeros((), device=self.device)

    def train(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch by the schedule, gradients accumulated.
        Returns (this rank's share of the cross-entropy, the load-balancing loss), each summed
        over the pipeline's stages, as means over the micro-batches."""
        if len(micro_batches) != self.schedule.num_micro:
            raise ValueError(f"the schedule was built for {self.schedule.num_micro} micro-batches, "
                             f"got {len(micro_batches)}")
        self._reset(micro_batches, training=True)
        for j, op in enumerate(self.schedule.ops[self.rank]):
            if op.kind in ("F", "FB"):
                self._forward(op.stage, op.micro, train=True)
            if op.kind == "B":
                self._backward(op.stage, op.micro, op.defer_weight, j)
            elif op.kind == "FB":
                self._backward(op.b_stage, op.b_micro, op.defer_weight, j)
            elif op.kind == "W" and not self.fsdp:
                with self._busy():
                    self.weight_grads.pop()
        self.weight_grads.flush()
        ce = sum((rank_loss(ce, None, self.micro[m].local_label_tokens, self.micro[m].label_tokens, 0.0,
                            self.data_ranks) for m, ce in self.ce.items()), torch.zeros((), device=self.device))
        return self._finish(ce / len(micro_batches), self.aux_sum)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only, every micro-batch through the stages in order. Returns the sum over
        micro-batches of this rank's mean cross-entropy × its labelled tokens."""
        self._reset(micro_batches, training=False)
        for m in range(len(micro_batches)):
            for s in sorted(self.stages):
                self._forward(s, m, train=False)
        total = sum((ce * self.micro[m].local_label_tokens for m, ce in self.ce.items()),
                    torch.zeros((), device=self.device))
        return self._finish(total)[0]

    def _finish(self, *totals: torch.Tensor) -> list[torch.Tensor]:
        """Wait for the sends; sum the totals over the stages (only the last one has the loss)."""
        for work, _ in self.pending:
            work.wait()
        totals = list(totals)
        comm.all_reduce_sum_(totals, self.group, kind="metrics")
        self.pending, self.saved, self.inbox = [], {}, {}
        return totals


def _directed_links(mesh: Mesh) -> dict[tuple[int, int], dist.ProcessGroup]:
    """A process group per direction between neighbouring pipeline ranks: (from, to) pp ranks ->
    group. With NCCL, sends and receives between two ranks on one communicator queue on one stream,
    so a send still waiting for its receiver would hold up this rank's receive of a message the
    peer sent first; one communicator per direction keeps the two flows apart. Every rank creates
    every group, in the same order (creating a group is collective)."""
    grid = mesh.device_mesh.mesh  # global ranks, axes (pp, ...)
    pipelines = grid.movedim(0, -1).reshape(-1, grid.shape[0]).tolist()  # one row per pipeline
    me, links = dist.get_rank(), {}
    for ranks in pipelines:
        for i in range(len(ranks) - 1):
            for a, b in ((i, i + 1), (i + 1, i)):
                group = dist.new_group([ranks[i], ranks[i + 1]])
                if me in ranks:
                    links[(a, b)] = group
    return links
