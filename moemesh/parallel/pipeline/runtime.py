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

Overlapped FB ops (`overlap`, `parallel.pp_overlap`, under EP). An FB op pairs the forward of one
(stage, micro-batch) with the backward of another; each decoder layer runs attention, route,
dispatch all-to-all, experts, combine all-to-all, aggregate, and its backward the same in reverse.
The two chunks run as coroutines: the backward on this thread (its backward functions on
autograd's threads), the forward on a worker thread, exactly one of them at any moment. Every EP
all-to-all, of either chunk and either direction, is launched asynchronously (`async_op=True`:
NCCL runs it on its own stream) and, between its launch and its `wait`, hands control to the other
chunk (`comm.while_in_flight`), which queues its compute until it launches an all-to-all of its
own and hands back. So one chunk's compute runs while the other's tokens travel, in DualPipe's
order: B combine⁻¹ launch | F attention, route, dispatch launch | B experts⁻¹, dispatch⁻¹ launch |
F experts, combine launch | B route⁻¹, attention⁻¹, next combine⁻¹ launch | ... The backward goes
first (the forward first when the backward's stage has no MoE layer); once one chunk is done the
other runs to its end. The compute stream waits for an all-to-all only at its `wait`. Control
passes only at all-to-alls, so a rank issues its collectives in one fixed order, the same on
every rank of a group (EP, TP and data-parallel peers run the same ops), and each chunk computes
exactly what it computes alone: the gradients are bitwise those of the sequential FB op. The op
takes both inputs first and posts its outputs after both chunks, the forward's first, the order
`schedule.messages` assumes; `simulate` treats an FB op as a unit, so this cannot deadlock either.
A thread rather than a generator carries the forward so that it runs the same code as any other
forward — `RankStages`, the decoder layers of every family, the dispatchers and their TP wrapper,
with no stepwise twins of them — keeping its own grad mode, autocast, device and stream, which
are per thread (autograd runs backward functions with grad mode off, on a thread of its own). A
hand-over costs the host some 15 µs.

The forward chunks run on one thread for the runner's life (`_Worker`): torch keeps cuDNN's
attention graphs and cuBLAS handles per thread, and a thread per op built them again at every op
— ~50 ms of idle GPU each, which had made overlapped FB ops 2.3× slower than sequential ones. On
four H200s (docs/benchmarks.md, 2026-11-27) they are now 1.14× faster under DualPipeV (pp=2 ×
ep=2, 6-layer Qwen3-30B-A3B shape). Without a pipeline, under EP, `schedule.paired` runs one
rank's micro-batches as F0, (F1, B0), (F2, B1), ..., B(n-1) through this runner, and with
`train.cuda_graphs` the trainer captures the whole schedule as one CUDA graph (the host launches
a step, not its thousands of kernels); with both, the EP step's GPUs idled 7–10% on two H200s.

Limits. `parallel.pp_overlap` stays off by default: on the 6-layer shape, without a pipeline, it
gains 1.03–1.04× under CUDA graphs and 0.94–1.16× without them (two and four GPUs). With the
`all_to_all` dispatcher the forward's dispatch also copies its split sizes to the host, once per
MoE layer, blocking the CPU until everything queued before it has run. The chunks share one
compute stream: compute overlaps communication, never other compute. When the two stages hold
unequal numbers of MoE layers, the chunk with more all-to-alls finishes alone. Without EP (nothing
to overlap) and under FSDP (whose per-module unshard/reshard state cannot take a forward in the
middle of a backward: the backward's end reshards every module) FB ops run forward, then backward.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moemesh.ops.weight_grad import WeightGradStore
from moemesh.parallel import comm
from moemesh.parallel.data import rank_loss
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pipeline.schedule import Op, Schedule, messages
from moemesh.parallel.pipeline.stage import RankStages, Stage


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # this rank's slice, on the device: input ids (and labels, without `labels`)
    local_label_tokens: int  # labelled positions in the slice
    # ... in the whole micro-batch (all data-parallel ranks); of packed rows, the step's mean a micro-batch
    label_tokens: float
    labels: torch.Tensor | None = None  # packed rows: -100 where untrained
    positions: torch.Tensor | None = None  # packed rows: [B, T], 0 where each row starts (its own attention)


@dataclass
class _Saved:
    inputs: torch.Tensor | None  # the received hidden states (a leaf whose gradient goes back)
    output: torch.Tensor  # hidden states sent on, or the last stage's scaled loss
    prob_sums: torch.Tensor | None  # [layers, E]: the stage's MoE layers' summed router probabilities, this rank's
    prob_totals: torch.Tensor | None  # ... summed over the data-parallel ranks (detached)
    num_tokens: int  # tokens per MoE layer in the micro-batch (all data-parallel ranks)


class PipelineRunner:
    def __init__(
        self,
        module: RankStages,
        mesh: Mesh,
        schedule: Schedule,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        overlap: bool = True,
    ):
        """`module`: this rank's stages of the model `parallelize` cut (FSDP's root, when it shards)."""
        self.model, self.schedule, self.autocast = module.model, schedule, autocast
        # FB ops overlap their chunks where there are all-to-alls to hide (and not under FSDP).
        self.overlap = overlap and mesh.dims.ep > 1
        self.group = mesh.group("pp")
        self.rank = mesh.rank("pp")
        self.links = _directed_links(mesh)
        self.data_ranks = mesh.dims.batch_size
        self.stages: dict[int, Stage] = module.stages
        self.module = module
        self.fsdp = False
        config = self.model.config
        self.num_experts = max(config.num_experts, 1)
        self.moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        self.aux = config.output_router_logits  # train the load-balancing loss
        self.aux_coef = config.router_aux_loss_coef
        self.weight_grads = WeightGradStore()
        self.worker: _Worker | None = None  # the thread of overlapped FB ops' forwards, made at the first
        self.op_times: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        # What each peer sends this rank, in its order (training; evaluation goes stage by stage).
        self.expected = {src: sent for (src, dst), (sent, _) in messages(schedule).items() if dst == self.rank}
        self.device = next(self.model.parameters()).device
        # Messages travel in fp32. Weights stored in bf16 keep the residual stream in bf16, which
        # a received hidden state is cast back to (exactly), as one process would have it.
        storage = next(self.model.parameters()).dtype
        self.narrow_dtype = storage if storage.itemsize < 4 else None

    def use_fsdp(self) -> None:
        """The model is sharded by FSDP (`apply_fsdp` with `root=self.module`): reduce-scatter each
        block's gradients once per step, in the backward of its stage's last micro-batch (FSDP
        accumulates them unsharded before), and the root's in this rank's last backward. Weight
        gradients are then not deferred: FSDP reduces a block's gradients when its backward ends."""
        self.fsdp = True
        backwards = [
            (j, op.stage if op.kind == "B" else op.b_stage)
            for j, op in enumerate(self.schedule.ops[self.rank])
            if op.kind in ("B", "FB")
        ]
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
    # A forward or backward is: take its input message, compute, post its output message. The
    # overlapped FB op takes both inputs, computes both chunks interleaved, then posts both.
    def _forward(self, s: int, m: int, train: bool) -> None:
        x, counts = self._forward_input(s, m, train)
        with self._busy():
            message = self._forward_compute(s, m, x, counts, train)
        if message:
            self._post(*message)

    def _forward_input(self, s: int, m: int, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.stages[s].first:
            return self.micro[m].tokens, torch.zeros(self.num_experts, device=self.device)
        x, counts = self._take(("act", s - 1, m), self._hidden_shape(m))
        if self.narrow_dtype is not None:  # back to the residual stream's dtype (the message is fp32)
            x = x.to(self.narrow_dtype)
        return x.requires_grad_(train), counts

    def _forward_compute(self, s: int, m: int, x: torch.Tensor, counts: torch.Tensor, train: bool):
        """Runs the stage; returns the message to post (None from the last stage)."""
        stage, micro = self.stages[s], self.micro[m]
        tokens, message = micro.tokens, None
        positions = torch.arange(tokens.shape[1], device=self.device) if micro.positions is None else micro.positions
        labels = tokens if micro.labels is None else micro.labels
        with self.autocast():
            out, layer_counts, prob_sums, prob_totals, num_tokens = self.module(
                s, x, positions, labels, reduce_stats=train
            )
            if layer_counts is not None:
                counts = counts + layer_counts.sum(0).float()
            if stage.last:
                self.ce[m] = out.detach().float()
                self.total_counts[m] = counts
                output = rank_loss(out, None, micro.local_label_tokens, micro.label_tokens, 0.0, self.data_ranks) / len(
                    self.micro
                )
            else:
                output = out
                message = (("act", s, m), s + 1, [out.detach().float(), counts])
        if train:
            self.saved[(s, m)] = _Saved(x if not stage.first else None, output, prob_sums, prob_totals, num_tokens)
        return message

    def _backward(self, s: int, m: int, defer_weight: bool, op_index: int) -> None:
        grad, counts = self._backward_input(s, m)
        with self._busy():
            message = self._backward_compute(s, m, grad, counts, defer_weight, op_index)
        if message:
            self._post(*message)

    def _backward_input(self, s: int, m: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        if self.stages[s].last:
            return None, self.total_counts.pop(m)
        return self._take(("grad", s + 1, m), self._hidden_shape(m))

    def _backward_compute(
        self, s: int, m: int, grad: torch.Tensor | None, counts: torch.Tensor, defer_weight: bool, op_index: int
    ):
        """Backward of the stage; returns the message to post (None from the first stage)."""
        stage, saved = self.stages[s], self.saved.pop((s, m))  # freed once this backward is done
        if self.fsdp:
            self._set_gradient_sync(s, op_index)
            defer_weight = False
        outputs, grads = [saved.output], [None if grad is None else grad.to(saved.output.dtype)]
        if saved.prob_sums is not None and self.aux:
            self.aux_sum += self._aux_share(saved.prob_totals, saved.num_tokens, counts) / len(self.micro)
            # Each data-parallel rank's share of the stage's share: they add up to it, and their
            # gradients are those of the sum (it is linear in the probabilities).
            outputs.append(self.aux_coef * self._aux_share(saved.prob_sums, saved.num_tokens, counts) / len(self.micro))
            grads.append(None)
        with self.weight_grads.deferring(defer_weight):
            torch.autograd.backward(outputs, grads)
        return None if stage.first else (("grad", s, m), s - 1, [saved.inputs.grad.float(), counts])

    def _forward_backward(self, op: Op, op_index: int) -> None:
        """An FB op with its chunks overlapped: the backward runs on this thread (and autograd's),
        the forward on a worker thread, one of them at a time; each all-to-all hands over to the
        other chunk between its launch and its wait (`_Overlap`). Inputs are taken and outputs
        posted in the order of the sequential FB op's messages: the forward's, then the backward's."""
        f_input = self._forward_input(op.stage, op.micro, True)
        b_input = self._backward_input(op.b_stage, op.b_micro)
        # The backward starts, unless it has no all-to-all for the forward's compute to hide.
        overlap, f_result = _Overlap(first="B" if self._exchanges(op.b_stage) else "F"), []
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

        def forward() -> None:
            overlap.wait_turn("F")
            try:
                with contextlib.ExitStack() as context:
                    context.enter_context(torch.enable_grad())
                    if stream is not None:  # the device and stream are per thread
                        torch.cuda.set_device(self.device)
                        context.enter_context(torch.cuda.stream(stream))
                    f_result.append(self._forward_compute(op.stage, op.micro, *f_input, train=True))
            except BaseException as error:
                f_result.append(error)
            finally:
                overlap.finish("F")

        if self.worker is None:
            self.worker = _Worker(owner=self)
        overlap.forward_thread = self.worker.thread
        with self._busy(), comm.while_in_flight(overlap.switch):
            done = self.worker.submit(forward)
            try:
                overlap.wait_turn("B")
                b_message = self._backward_compute(op.b_stage, op.b_micro, *b_input, op.defer_weight, op_index)
            finally:
                overlap.finish("B")  # the forward runs to its end
                done.wait()
        if isinstance(f_result[0], BaseException):
            raise f_result[0]
        for message in (f_result[0], b_message):
            if message:
                self._post(*message)

    def _exchanges(self, s: int) -> bool:
        """Whether stage s has MoE layers (whose all-to-alls an overlapped chunk can hide behind)."""
        return any(getattr(self.model.model.layers[i], "is_moe", False) for i in self.stages[s].layers)

    def _hidden_shape(self, m: int) -> tuple[int, ...]:
        return (*self.micro[m].tokens.shape, self.model.config.hidden_size)

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

    def _aux_share(self, prob_sums: torch.Tensor, num_tokens: int, counts: torch.Tensor) -> torch.Tensor:
        """The part of the load-balancing loss of the probabilities `prob_sums` [layers, E] (a
        stage's, or one rank's share of them), given all layers' token counts."""
        pooled = float(num_tokens * self.moe_layers)
        return self.num_experts * torch.sum(counts / pooled * prob_sums.sum(0).float() / pooled)

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
            raise ValueError(
                f"the schedule was built for {self.schedule.num_micro} micro-batches, got {len(micro_batches)}"
            )
        self._reset(micro_batches, training=True)
        for j, op in enumerate(self.schedule.ops[self.rank]):
            if op.kind == "FB" and self.overlap and not self.fsdp:
                self._forward_backward(op, j)
                continue
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
        ce = sum(
            (
                rank_loss(ce, None, self.micro[m].local_label_tokens, self.micro[m].label_tokens, 0.0, self.data_ranks)
                for m, ce in self.ce.items()
            ),
            torch.zeros((), device=self.device),
        )
        return self._finish(ce / len(micro_batches), self.aux_sum)

    @torch.no_grad()
    def evaluate(self, micro_batches: list[MicroBatch]) -> torch.Tensor:
        """Forward only, every micro-batch through the stages in order. Returns the sum over
        micro-batches of this rank's mean cross-entropy × its labelled tokens."""
        self._reset(micro_batches, training=False)
        for m in range(len(micro_batches)):
            for s in sorted(self.stages):
                self._forward(s, m, train=False)
        total = sum(
            (ce * self.micro[m].local_label_tokens for m, ce in self.ce.items()), torch.zeros((), device=self.device)
        )
        return self._finish(total)[0]

    def _finish(self, *totals: torch.Tensor) -> list[torch.Tensor]:
        """Wait for the sends; sum the totals over the stages (only the last one has the loss)."""
        for work, _ in self.pending:
            work.wait()
        totals = list(totals)
        comm.all_reduce_sum_(totals, self.group, kind="metrics")
        self.pending, self.saved, self.inbox = [], {}, {}
        return totals


class _Overlap:
    """The two chunks of an overlapped FB op take turns, as coroutines: exactly one runs at any
    moment, and control passes only in `switch`, which an all-to-all calls between its launch and
    its wait. So every rank issues its collectives in one fixed order, the same on all the ranks
    of a group. Chunk `first` ("F" or "B") starts; once a chunk is done, the other runs to its end."""

    def __init__(self, first: str):
        self.turn, self.done = first, set()
        self.changed = threading.Condition()
        self.forward_thread: threading.Thread | None = None

    def _mine(self) -> tuple[str, str]:
        forward = threading.current_thread() is self.forward_thread  # else this thread or autograd's
        return ("F", "B") if forward else ("B", "F")

    def wait_turn(self, me: str) -> None:
        with self.changed:
            self.changed.wait_for(lambda: self.turn == me)

    def switch(self) -> None:
        me, other = self._mine()
        with self.changed:
            if other in self.done:
                return
            self.turn = other
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.turn == me)

    def finish(self, me: str) -> None:
        with self.changed:
            self.done.add(me)
            self.turn = "B" if me == "F" else "F"
            self.changed.notify_all()


class _Worker:
    """One thread that runs the overlapped FB ops' forward chunks, one after another, for the
    runner's life. Not a thread per op: torch keeps caches per thread — cuDNN's attention graphs,
    cuBLAS handles — and a new thread builds them again. On four H200s a fresh thread per op cost
    ~50 ms of an idle GPU at each op's first attention (docs/benchmarks.md)."""

    def __init__(self, owner: object):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=_Worker._run, args=(self.jobs,), name="moemesh-pp-forward", daemon=True)
        self.thread.start()
        weakref.finalize(owner, self.jobs.put, None)  # the thread ends with its runner

    def submit(self, job: Callable[[], None]) -> threading.Event:
        """Run job() on the thread (it must catch its own errors); the event is set once it returned."""
        done = threading.Event()
        self.jobs.put((job, done))
        return done

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        # Holds nothing between jobs: a finished job's closure (the runner, its model) can go.
        while (item := jobs.get()) is not None:
            job, done = item
            try:
                job()
            finally:
                done.set()
                del job, done, item


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
