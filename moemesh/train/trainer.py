"""The training loop: data -> model -> AdamW, with validation, metrics, checkpoints and a plot.

One optimizer step consumes `train.global_batch` sequences in micro-batches of `train.micro_batch`,
whatever the layout; each data-parallel rank runs its contiguous slice of every micro-batch and
accumulates gradients. A rank's loss is its share of the micro-batch loss (`rank_loss`) divided by
the number of micro-batches, so the gradients, summed over micro-batches here and over ranks by
`reduce_gradients`, are those of the global batch's mean loss in one process. With
`train.cuda_graphs` each micro-batch's forward and backward replay one CUDA graph in one process;
under expert parallelism the whole step's schedule (one rank's 1F1B, or its paired forwards and
backwards with `parallel.pp_overlap`) replays one graph, collectives included, so the host
launches a step, not each of its thousands of kernels. Captured at the first step (`cuda_graph.py`).

Under the gathering expert-parallel dispatcher (`parallel/expert.py`) each forward is checked
before its backward (a pipeline's step, an evaluation: as a whole): one whose expert buffer was
full runs again with a larger buffer, from the same random state and expert counts, and the run
says so in one line. The loop turns Python's cyclic garbage collector off and collects by hand
every GC_EVERY steps, at the same step on every rank.

A step whose loss or gradient norm is not finite changes nothing but the data position: no update
of the weights, of AdamW's moments and step count, or of the learning-rate schedule, which counts
updates (as Megatron-LM and DeepSpeed do with the steps they skip), so a bad batch eats neither
warm-up nor decay. `train.max_bad_steps` such steps in a row stop the run (`DivergedError`), a
resumed run counting on from its checkpoint's count, and no checkpoint is ever written with
non-finite weights.

Each step's record goes to metrics.jsonl and, with `train.report_to`, to TensorBoard and W&B
(`report.py`), from the main rank; the per-layer expert loads are `expert_load.py`'s.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

from moemesh.checkpoint import integrity
from moemesh.checkpoint.adapters import LORA_FILE, is_lora_checkpoint, lora_record, read_adapter
from moemesh.checkpoint.dcp import (
    CHECKPOINTS,
    checkpoint_path,
    checkpoint_steps,
    latest_checkpoint,
    load_training_state,
    prune_checkpoints,
    save_checkpoint,
    training_state,
)
from moemesh.checkpoint.load import load_weights
from moemesh.checkpoint.quantized_base import keep_base_quantized
from moemesh.config import RunConfig, resolve_device
from moemesh.data.dataset import labels_of, load_dataset, rank_slice
from moemesh.data.packing import Packed, PackedDataset
from moemesh.data.tokenizer import HFTokenizer
from moemesh.errors import CheckpointError, ConfigError, DivergedError
from moemesh.models import MoECausalLM
from moemesh.models.build import init_weights, meta_model
from moemesh.models.lora import apply_lora, is_adapter
from moemesh.models.moe import EXPERT_BANKS
from moemesh.parallel import comm
from moemesh.parallel.data import clip_grad_norm_, label_tokens, local, rank_loss, reduce_gradients
from moemesh.parallel.expert import fit_capacity, start_capacity
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.parallelize import DTYPES, materialize, parallelize
from moemesh.parallel.pieces import local_view
from moemesh.parallel.pipeline.runtime import MicroBatch, PipelineRunner
from moemesh.train.cuda_graph import CapturedStep
from moemesh.train.expert_load import expert_load_metrics
from moemesh.train.flops import flops_per_token, peak_flops
from moemesh.train.metrics import METRICS_FILE, MetricsLog, read_metrics
from moemesh.train.optim import build_optimizer, build_scheduler
from moemesh.train.plot import plot_losses
from moemesh.train.progress import Progress, format_count, format_duration
from moemesh.train.report import Report
from moemesh.train.router_bias import update_router_bias
from moemesh.train.threads import Threads, cpu_threads

# Python's cyclic garbage collector, left to itself, stops a rank for tens of milliseconds every few
# steps at a moment of its own; the other ranks then wait for it at the next collective. The loop
# collects the young generations by hand instead, at the same step on every rank (as torchtitan does).
GC_EVERY = 50


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    seconds: float
    first_val_loss: float | None
    last_val_loss: float | None
    checkpoint: Path | None


def _max_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS; Linux reports KiB


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"rng_cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng_cuda"] = torch.cuda.get_rng_state(device)
    return state


def _expert_loads(model: MoECausalLM) -> dict[torch.nn.Module, torch.Tensor]:
    """A copy of the expert loads each router has counted so far (`models.moe.count_load`)."""
    return {m: m.expert_load.clone() for m in model.modules() if getattr(m, "expert_load", None) is not None}


def _restore_expert_loads(model: MoECausalLM, loads: dict[torch.nn.Module, torch.Tensor]) -> None:
    for module in model.modules():
        if getattr(module, "expert_load", None) is None:
            continue
        if module in loads:
            module.expert_load.copy_(loads[module])
        else:  # began counting in the dropped run
            module.expert_load.zero_()


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state:
        torch.cuda.set_rng_state(state["rng_cuda"], device)


class Trainer:
    def __init__(self, config: RunConfig, stream: TextIO | None = None, threads: Threads | None = None):
        self.config = resolve_device(config)
        self.train_config = train = config.train
        parallel = config.parallel
        self.mesh = init_mesh(
            ParallelDims(
                pp=parallel.pp,
                dp_replicate=parallel.dp_replicate,
                dp_shard=parallel.dp_shard,
                ep=parallel.ep,
                tp=parallel.tp,
            ),
            timeout_s=parallel.timeout_s,
            device_type=torch.device(train.device).type,
        )
        self.rank, self.ranks = self.mesh.rank("batch"), self.mesh.dims.batch_size
        self.is_main = int(os.environ.get("RANK", "0")) == 0  # the rank that prints and writes files
        self.stream = (sys.stdout if stream is None else stream) if self.is_main else open(os.devnull, "w")
        self.device = torch.device(train.device)
        self.autocast_dtype = DTYPES[train.dtype]
        self.run_dir = Path(train.run_dir)

        self._refuse_earlier_run()  # before the data and the weights: a 30B model takes a minute to read
        torch.manual_seed(train.seed)
        self.dataset, self.tokenizer = load_dataset(config.data, train.seq_len, train.seed, config.model.vocab_size)
        # Made on the meta device, laid out, and only then allocated: each rank makes (or reads)
        # only its part. bf16 weights and AdamW state take half the memory of fp32 master
        # weights, at bf16's rounding of every update (as transformers trains a bf16 model).
        # Under LoRA the base is frozen and kept in the compute dtype (bf16 on a GPU: it needs no
        # master copy), the adapters in param_dtype.
        self.lora = config.lora
        self.model: MoECausalLM = meta_model(
            config.model, DTYPES[train.dtype if self.lora.enabled else train.param_dtype]
        )
        self.model.activation_checkpointing = train.activation_checkpointing
        # Counted on the whole model, before the layout keeps this rank's part, and the base's
        # before adapters join it.
        self.num_params = (self.model.num_params(), self.model.num_params(active=True))
        self.adapter = None  # adapters to start from (lora.init_from), else from the seed
        if self.lora.init_from:
            self.adapter = read_adapter(self.lora.init_from, config.model)
            self.adapter.dropout = self.lora.dropout
            self.adapted = self.adapter.attach(self.model, DTYPES[train.param_dtype])
        else:
            self.adapted = apply_lora(self.model, self.lora, DTYPES[train.param_dtype]) if self.lora.enabled else {}
        self.adapter_params = sum(p.numel() for name, p in self.model.named_parameters() if is_adapter(name))
        self.flops_per_token = flops_per_token(self.model, train.seq_len)
        layout = parallelize(self.model, self.mesh, parallel, self.config.step_shape)
        self.kept_quantized = None  # a quantized base kept in its bytes (checkpoint/quantized_base.py)
        if self.lora.enabled and self.lora.keep_quantized and train.init_from:
            self.kept_quantized = keep_base_quantized(self.model, train.init_from, self.device)
        materialize(self.model, self.device, None if train.init_from else train.seed)
        if train.init_from and is_lora_checkpoint(train.init_from):
            raise ConfigError(
                f"train.init_from = {train.init_from!r} is a LoRA run, which holds adapters and no base weights: "
                "name its base as train.init_from, and the run as lora.init_from to start from its adapters"
            )
        self.init_source = load_weights(self.model, train.init_from, self.mesh) if train.init_from else None
        if self.adapter is not None:
            self.adapter.load_into(self.model)
        elif self.init_source is not None and self.lora.enabled:  # the base was read; the adapters start from the seed
            init_weights(self.model, train.seed, local_view, only=is_adapter)
        self.kept_whole = layout.kept_whole
        self.pipeline = None
        if layout.stages is not None:
            self.pipeline = PipelineRunner(
                layout.stages, self.mesh, layout.schedule, self._autocast, overlap=parallel.pp_overlap
            )
            if parallel.dp_shard > 1:
                self.pipeline.use_fsdp()
        self.optimizer = build_optimizer(self.model, train)  # on the shards: its moments are sharded too
        self.scheduler = build_scheduler(self.optimizer, train)
        # Under the gathering EP dispatcher each forward is checked for a full expert buffer.
        self.gathers = parallel.ep > 1 and parallel.ep_dispatch == "gather"
        if self.gathers:
            start_capacity(self.model, parallel.ep_capacity)
        self.notes: list[str] = []  # said between progress lines (`run`)
        self.threads = threads  # a CPU run's, as `train` chose them (said in the first lines)
        self.step = 0
        self.data_position = 0  # sequences of the training order consumed so far
        self.bad_steps = 0  # skipped steps in a row (non-finite loss or gradient norm), up to now
        self.checkpoint: Path | None = None  # the newest this run wrote or resumed from
        val = self.dataset.val_sequences(train.eval_sequences)
        self.val_batches = val[: len(val) // self.ranks * self.ranks].split(train.micro_batch)
        self.peak_flops = peak_flops(self.device)
        self.captured: CapturedStep | None = None  # train.cuda_graphs: made at the first step
        self.captured_counts: list[tuple[int, int]] = []  # the label counts a schedule's graph scales by
        if train.cuda_graphs and (self.device.type != "cuda" or self.autocast_dtype != torch.bfloat16):
            raise ConfigError(
                f"train.cuda_graphs needs a GPU and train.dtype bfloat16 (the experts' grouped GEMMs "
                f"wait for the host otherwise); this run has {self.device} and {train.dtype}"
            )
        if train.cuda_graphs and self.pipeline is not None and isinstance(self.dataset, PackedDataset):
            raise ConfigError(
                "train.cuda_graphs under expert or pipeline parallelism does not cover packed rows (a chat or "
                "instruction file) yet: set train.cuda_graphs = false"
            )

    def close(self) -> None:
        """Free the step's CUDA graph, if any: before the process group goes (`CapturedStep.close`)."""
        if self.captured is not None:
            self.captured.close()
            self.captured = None

    # ---- one step ---------------------------------------------------------------------------
    def _autocast(self):
        if self.autocast_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _local(self, batch: torch.Tensor | Packed) -> tuple[torch.Tensor | Packed, torch.Tensor | Packed]:
        """This rank's contiguous slice of a (micro-)batch, on the host (to count labels without
        waiting for the device) and on the device."""
        local = rank_slice(batch, self.rank, self.ranks)
        return local, local.to(self.device, non_blocking=True)

    def train_step(self) -> dict[str, float | bool | None]:
        train = self.train_config
        global_batch = self.dataset.train_sequences(self.data_position, train.global_batch)
        self.data_position += train.global_batch
        ce_sum, aux_sum = self.forward_backward(global_batch.split(train.micro_batch))
        reduce_gradients(self.model, self.mesh)
        max_norm = train.grad_clip if train.grad_clip > 0 else float("inf")
        grad_norm = clip_grad_norm_(self.model, max_norm, self.mesh)
        comm.all_reduce_sum_([ce_sum], self.mesh.group("batch"), kind="metrics")
        lr = self.scheduler.get_last_lr()[0]
        record = {
            "loss": ce_sum.item(),
            "aux_loss": None if aux_sum is None else aux_sum.item(),
            "lr": lr,
            "grad_norm": grad_norm.item(),
            **expert_load_metrics(self.model, self.mesh, self.device),  # before the bias rule clears the counts
        }
        # The same decision on every rank: the loss is summed over the batch and pipeline ranks (TP
        # ranks compute it alike) and the squared gradient norm over every axis that splits a
        # gradient, so a non-finite term on any rank makes them non-finite on all.
        if math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]):
            self.optimizer.step()
            # DeepSeek-V3's expert-choice bias, from the loads of the whole global batch
            update_router_bias(self.model, train.router_bias_update_rate, self.mesh.group("batch"))
            self.scheduler.step()
        else:
            update_router_bias(self.model, 0.0, None)  # forgets this step's expert loads, moves nothing
            record["skipped"] = True
        self.optimizer.zero_grad(set_to_none=not train.cuda_graphs)  # a graph adds into the same tensors
        self.step += 1
        return record

    def forward_backward(
        self, micro_batches: list[torch.Tensor] | list[Packed]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's forwards and backwards (through the pipeline, the CUDA graph or in turn),
        its gradients left in the parameters before they are reduced over the ranks; returns this
        rank's share of the mean cross-entropy over the step's labelled tokens and the mean
        load-balancing loss."""
        if self.pipeline is not None:  # forwards and backwards interleave: the step is what runs again
            share = _label_share(micro_batches)
            batches = [self._micro_batch(batch, share) for batch in micro_batches]
            train = self._replayed_schedule if self.train_config.cuda_graphs else self.pipeline.train
            ce_sum, aux_sum = self._within_capacity(lambda: train(batches), f"step {self.step + 1}", ran_backward=True)
            return ce_sum, aux_sum if self.config.model.output_router_logits else None
        if self.train_config.cuda_graphs:
            if isinstance(micro_batches[0], Packed):
                return self._replayed_packed(micro_batches)
            return self._replayed_forward_backward(micro_batches)
        return self._forward_backward(micro_batches)

    def _within_capacity(self, compute, what: str, ran_backward: bool = False):
        """compute() until no expert-parallel buffer dropped a token in it (`parallel/expert.py`):
        after one that did, the buffers are enlarged and compute runs again from the state it
        started from — the routers' expert counts and the random state as they were, and where it
        ran backward (a pipeline's step) no gradient. Without the gathering dispatcher, compute()."""
        if not self.gathers:
            return compute()
        rng, loads = _rng_state(self.device), _expert_loads(self.model)
        while True:
            result = compute()
            overflowed = fit_capacity(self.model, dist.group.WORLD)
            if not overflowed:
                return result
            del result  # the dropped run's graph and activations, before the next run makes its own
            self.notes.append(f"{what} computed again: an expert-parallel buffer was full ({'; '.join(overflowed)})")
            if ran_backward:
                self.optimizer.zero_grad(set_to_none=True)
            self.close()  # a graph's buffers have the old capacity: captured again
            _restore_expert_loads(self.model, loads)
            _set_rng_state(rng, self.device)

    def _replayed_schedule(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """The schedule's step (`self.pipeline.train`: expert parallelism without a pipeline) as the
        replay of one CUDA graph, captured at the first call and again when the micro-batches'
        label counts (constants of the loss's scale in the graph) or the expert buffers change;
        the gradients added into the parameters' `.grad` (train/cuda_graph.py)."""
        tokens = torch.stack([batch.tokens for batch in batches])
        counts = [(batch.local_label_tokens, batch.label_tokens) for batch in batches]
        if self.captured is None or self.captured_counts != counts:
            if self.captured is not None:
                self.notes.append(
                    f"step {self.step + 1} captured again: its micro-batches' labelled tokens differ from the "
                    "captured step's (constants of the graph's loss scale; sequences of one length keep them)"
                )

            def step(tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return tuple(self.pipeline.train([MicroBatch(t, *c) for t, c in zip(tokens.unbind(0), counts)]))

            trained = [p for p in self.model.parameters() if p.requires_grad]
            self.close()  # the old graph's pool goes first
            self.captured_counts = counts
            self.captured = CapturedStep(step, [tokens], trained)
            update_router_bias(self.model, 0.0, None)  # forget the warm-up's expert loads
        return list(self.captured(tokens))

    def _micro_batch(self, micro_batch: torch.Tensor | Packed, share: float | None = None) -> MicroBatch:
        """The pipeline's micro-batch; `share`: the step's labelled tokens over its micro-batches
        (`_label_share`; None: this micro-batch's own)."""
        local, batch = self._local(micro_batch)
        tokens, labels, positions = _inputs(batch)
        share = label_tokens(labels_of(micro_batch)) if share is None else share
        return MicroBatch(tokens, label_tokens(labels_of(local)), share, labels, positions)

    def _forward_backward(
        self, micro_batches: list[torch.Tensor] | list[Packed]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every micro-batch's forward and backward in turn (no pipeline); returns this rank's
        share of the mean cross-entropy and the mean load-balancing loss."""
        coef = self.config.model.router_aux_loss_coef
        ce_sum = torch.zeros((), device=self.device)
        aux_sum = None
        share = _label_share(micro_batches)  # the step's labelled tokens over the micro-batches
        for micro_batch in micro_batches:
            local, batch = self._local(micro_batch)
            tokens, labels, positions = _inputs(batch)
            shares = label_tokens(labels_of(local)), share
            with self._autocast():  # checked before its backward, which then runs on a full forward
                out = self._within_capacity(
                    lambda: self.model(tokens, labels=labels, positions=positions, return_logits=False),
                    f"step {self.step + 1}",
                )
            loss = rank_loss(out.ce_loss, out.aux_loss, *shares, coef, self.ranks)
            (loss / len(micro_batches)).backward()
            ce_sum += rank_loss(out.ce_loss.detach().float(), None, *shares, coef, self.ranks) / len(micro_batches)
            if out.aux_loss is not None:  # the same on every rank: computed from summed statistics
                aux = out.aux_loss.detach().float() / len(micro_batches)
                aux_sum = aux if aux_sum is None else aux_sum + aux
        return ce_sum, aux_sum

    def _replayed_forward_backward(self, micro_batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward_backward` as the replays of one CUDA graph, captured at the first call
        (train/cuda_graph.py). One process: its share of a micro-batch's loss is the whole."""
        coef, count = self.config.model.router_aux_loss_coef, len(micro_batches)

        def forward_backward(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            with self._autocast():
                out = self.model(tokens, labels=tokens, return_logits=False)
            (rank_loss(out.ce_loss, out.aux_loss, 1, 1, coef, 1) / count).backward()
            aux = None if out.aux_loss is None else out.aux_loss.detach().float()
            return out.ce_loss.detach().float(), aux

        ce_sum = torch.zeros((), device=self.device)
        aux_sum = None
        for micro_batch in micro_batches:
            tokens = micro_batch.to(self.device, non_blocking=True)
            if self.captured is None:
                trained = [p for p in self.model.parameters() if p.requires_grad]
                self.captured = CapturedStep(forward_backward, [tokens], trained)
                update_router_bias(self.model, 0.0, None)  # forget the warm-up's expert loads
            ce, aux = self.captured(tokens)
            ce_sum += ce / count
            if aux is not None:
                aux_sum = aux / count if aux_sum is None else aux_sum + aux / count
        return ce_sum, aux_sum

    def _replayed_packed(self, micro_batches: list[Packed]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward_backward` of packed rows as the replays of one CUDA graph, captured at the
        first call: its inputs the tokens, labels, positions and the micro-batch's weight in the
        step's mean (its labelled tokens vary from one micro-batch to the next)."""
        coef, count = self.config.model.router_aux_loss_coef, len(micro_batches)

        def forward_backward(tokens, labels, positions, weight):
            with self._autocast():
                out = self.model(tokens, labels=labels, positions=positions, return_logits=False)
            (rank_loss(out.ce_loss * weight, out.aux_loss, 1, 1, coef, 1) / count).backward()
            aux = None if out.aux_loss is None else out.aux_loss.detach().float()
            return (out.ce_loss.detach().float() * weight, aux)

        share = _label_share(micro_batches)
        ce_sum = torch.zeros((), device=self.device)
        aux_sum = None
        for micro_batch in micro_batches:
            weight = torch.tensor(label_tokens(micro_batch.labels) / max(share, 1), dtype=torch.float32)
            inputs = [t.to(self.device, non_blocking=True) for t in (*_inputs(micro_batch), weight)]
            if self.captured is None:
                trained = [p for p in self.model.parameters() if p.requires_grad]
                self.captured = CapturedStep(forward_backward, inputs, trained)
                update_router_bias(self.model, 0.0, None)  # forget the warm-up's expert loads
            ce, aux = self.captured(*inputs)
            ce_sum += ce / count
            if aux is not None:
                aux_sum = aux / count if aux_sum is None else aux_sum + aux / count
        return ce_sum, aux_sum

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean language-model loss over the fixed validation sequences' labelled tokens (no
        auxiliary loss)."""
        what = f"the evaluation after step {self.step}"
        if self.pipeline is not None:
            batches = [self._micro_batch(batch) for batch in self.val_batches]
            total = self._within_capacity(lambda: self.pipeline.evaluate(batches), what)
            tokens_in_all = sum(label_tokens(labels_of(batch)) for batch in self.val_batches)
            comm.all_reduce_sum_([total], self.mesh.group("batch"), kind="metrics")
            return total.item() / tokens_in_all
        total, tokens_in_all = torch.zeros((), device=self.device), 0
        for batch in self.val_batches:
            local, on_device = self._local(batch)
            tokens, labels, positions = _inputs(on_device)
            with self._autocast():
                loss = self._within_capacity(
                    lambda: self.model(
                        tokens, labels=labels, positions=positions, output_router_logits=False, return_logits=False
                    ),
                    what,
                ).ce_loss
            total += loss.float() * label_tokens(labels_of(local))
            tokens_in_all += label_tokens(labels_of(batch))
        comm.all_reduce_sum_([total], self.mesh.group("batch"), kind="metrics")
        return total.item() / tokens_in_all

    # ---- checkpoints ------------------------------------------------------------------------
    def _state(self) -> dict:
        trainer = {
            "step": self.step,
            "data_position": self.data_position,
            "bad_steps": self.bad_steps,
            "threads": torch.get_num_threads(),  # a loss's last bits depend on it (train/threads.py)
            **_rng_state(self.device),
        }
        return training_state(self.model, self.optimizer, self.scheduler, trainer, trainable_only=self.lora.enabled)

    def save(self) -> Path:
        # Every rank checks its own part of the weights, and all learn whether any part is bad.
        finite = bool(torch.stack([local(p).isfinite().all() for p in self.model.parameters()]).all())  # one sync
        if not all(comm.all_gather_object(finite)):
            raise DivergedError(
                f"step {self.step}: the weights hold non-finite values, so no checkpoint is written; "
                f"the newest checkpoint is {self.checkpoint or 'none'} (a lower train.lr may help)"
            )
        path = checkpoint_path(self.run_dir, self.step)
        tokenizer_file = self.tokenizer.path if isinstance(self.tokenizer, HFTokenizer) else None
        extra = {LORA_FILE: lora_record(self.config, self.adapted)} if self.lora.enabled else {}
        if self.config.data.chat_template:  # the template the run rendered its rows with, for generate/serve
            extra["chat_template.jinja"] = Path(self.config.data.chat_template).read_bytes()
        save_checkpoint(path, self._state(), self.config.model, tokenizer_file, self.model, self.mesh, extra)
        self.checkpoint = path
        return path

    def restore(self, path: Path) -> None:
        trainer = {
            "step": 0,
            "data_position": 0,
            "bad_steps": 0,
            "threads": torch.get_num_threads(),
            **_rng_state(self.device),
        }
        if (path / LORA_FILE).is_file() and not self.lora.enabled:
            raise CheckpointError(
                f"{path} holds LoRA adapters ({LORA_FILE}), but this run trains the whole model: resume it with "
                "the [lora] settings it was written with"
            )
        if self.lora.enabled and not (path / LORA_FILE).is_file():
            raise CheckpointError(f"{path} holds a whole model's training state, but this run trains LoRA adapters")
        trainer = load_training_state(
            path, self.model, self.optimizer, self.scheduler, trainer, self.mesh, trainable_only=self.lora.enabled
        )
        self.step, self.data_position = int(trainer["step"]), int(trainer["data_position"])
        self.bad_steps = int(trainer["bad_steps"])
        _set_rng_state(trainer, self.device)
        self._resume_threads(int(trainer["threads"]))  # (a checkpoint of an older moemesh: this run's)

    def _resume_threads(self, saved: int) -> None:
        """A CPU run resumed on the thread count its checkpoint was written with (its losses' last
        bits depend on it), unless train.threads or OMP_NUM_THREADS set another: then it is said."""
        if self.threads is None or saved == self.threads.count:
            return
        if self.threads.chosen_here:
            torch.set_num_threads(saved)
            self.threads = Threads(saved, "the resumed run's, to reproduce its losses exactly", chosen_here=False)
            self._say(f"threads {saved}: {self.threads.why} (train.threads sets another)")
        else:
            self._say(
                f"threads {self.threads.count} ({self.threads.why}); the run it resumes computed on {saved}, so "
                "its losses from here may differ from an uninterrupted run's in the last bits"
            )

    # ---- the run ----------------------------------------------------------------------------
    def _start(self) -> MetricsLog:
        """Resume from the newest checkpoint that verifies, or start afresh in a run directory that
        holds no checkpoints: an earlier run's are deleted only when train.overwrite asks."""
        train, say = self.train_config, self._say
        checkpoints = self.run_dir / CHECKPOINTS
        self.run_dir.mkdir(parents=True, exist_ok=True)
        existing = checkpoint_steps(self.run_dir)
        if train.resume:
            checkpoint = latest_checkpoint(self.run_dir, report=say)
            if checkpoint is not None:
                self.restore(checkpoint)
                self.checkpoint = checkpoint
                say(f"resumed from {checkpoint} (step {self.step})")
                return self._metrics_log(resume_step=self.step)
            if existing:
                raise CheckpointError(
                    f"train.resume: none of the {len(existing)} checkpoints in {checkpoints} "
                    "verifies (each is named above); train.overwrite=true deletes them and "
                    "starts afresh"
                )
            say(f"train.resume: no checkpoint in {checkpoints} yet, starting at step 0")
        elif existing:  # train.overwrite: _refuse_earlier_run let it through
            say(f"train.overwrite: deleting the earlier run's {checkpoints} and starting afresh")
            if self.is_main:
                integrity.remove(checkpoints)
            comm.barrier()  # deleted before any rank writes a new one
        return self._metrics_log()

    def _refuse_earlier_run(self) -> None:
        """A run directory that holds an earlier run's checkpoints, without train.resume (continue
        it) or train.overwrite (delete it): refused at once, before anything is loaded."""
        train = self.train_config
        existing = checkpoint_steps(self.run_dir)
        if existing and not (train.resume or train.overwrite):
            raise ConfigError(
                f"{self.run_dir / CHECKPOINTS} holds the checkpoints of an earlier run (the newest: "
                f"{existing[0][1].name}): train.resume=true continues that run, "
                "train.overwrite=true deletes them and starts afresh"
            )

    def _metrics_log(self, resume_step: int | None = None) -> MetricsLog:
        # Only the main rank writes the file; the others log into nothing.
        return MetricsLog(self.run_dir / METRICS_FILE, resume_step) if self.is_main else MetricsLog(os.devnull)

    def _flush_notes(self, say) -> None:
        for note in self.notes:
            say(note)
        self.notes.clear()

    def _say(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def _describe(self) -> None:
        model, data, train = self.config.model, self.config.data, self.train_config
        total, active = self.num_params
        adapters = f"; {format_count(self.adapter_params)} more in LoRA adapters" if self.adapter_params else ""
        self._say(
            f"model   {model.model_type}: {model.num_hidden_layers} layers, hidden {model.hidden_size}, "
            f"{model.num_experts} experts top-{model.num_experts_per_tok}; "
            f"{format_count(total)} parameters, {format_count(active)} active per token{adapters}"
        )
        if isinstance(self.dataset, PackedDataset):
            self._say(
                f"data    {data.path} ({self.dataset.format} rows, data.train_on = {data.train_on!r}; tokenizer "
                f"{data.tokenizer}: {self.config.tokenizer_origin}): {self.dataset.describe()}"
            )
            template = self.dataset.template
            if template is not None and template.end_of_turn and template.end_of_turn != template.eos_token:
                self._say(
                    f"chat    a turn ends with {template.end_of_turn} (trained), not the tokenizer's eos "
                    f"{template.eos_token}: a served chat stops at either"
                )
        else:
            self._say(
                f"data    {data.path} (tokenizer {data.tokenizer}: {self.config.tokenizer_origin}): "
                f"{format_count(len(self.dataset.train_tokens))} training tokens, "
                f"{format_count(len(self.dataset.val_tokens))} validation tokens"
            )
        threads = f" ({self.threads})" if self.threads is not None else ""
        self._say(
            f"train   {train.steps} steps × {train.global_batch} sequences × {train.seq_len} tokens "
            f"on {self.device}{threads} in {train.dtype}; run directory {self.run_dir}"
        )
        if self.init_source is not None:
            self._say(f"init    weights of {self.init_source} (optimizer and step afresh)")
        if self.lora.enabled:
            self._say(f"lora    {self._what_trains()}")
        if self.kept_quantized is not None:
            self._say(f"base    {self.kept_quantized.describe()}")
        if self.mesh.dims.world_size > 1:
            self._say(f"layout  {self.mesh.dims.describe()}")
        if self.kept_whole:
            self._say(
                f"fsdp    {len(self.kept_whole)} tensors without an evenly divisible dimension stay whole on "
                f"each rank: {', '.join(self.kept_whole[:3])}{', ...' if len(self.kept_whole) > 3 else ''}"
            )

    def _what_trains(self) -> str:
        """A LoRA run's adapters — on projections (by kind), on expert banks — and the routers that
        train in full, which only a target naming them makes train."""
        adapted = {name: plan for name, plan in self.adapted.items() if plan is not None}
        banks = [name for name in adapted if name.rpartition(".")[2] in EXPERT_BANKS and ".experts." in name]
        projections = [name for name in adapted if name not in banks]
        routers = [name for name, plan in self.adapted.items() if plan is None]

        def kinds(names: list[str]) -> str:
            return ", ".join(dict.fromkeys(name.rpartition(".")[2] for name in names))

        parts = [f"{len(projections)} projections ({kinds(projections)})"] if projections else []
        if banks:
            layers = len({name.rpartition(".")[0] for name in banks})
            parts.append(f"{len(banks)} expert banks ({kinds(banks)} of every expert in {layers} MoE layers)")
        ranks = "/".join(map(str, sorted({rank for rank, _ in adapted.values()})))
        what = [f"rank {ranks} adapters on {' and '.join(parts)}"] if parts else []
        if routers:
            what.append(f"{len(routers)} routers in full (a target names them)")
        start = f" from {self.lora.init_from}" if self.lora.init_from else ""
        trained = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        frozen = "the rest of the base is frozen" if routers else "the base is frozen"
        return f"{'; '.join(what)}{start}; {format_count(trained)} parameters train on this rank, {frozen}"

    def run(self) -> TrainResult:
        train = self.train_config
        self._describe()
        metrics = self._start()
        report = None
        if self.is_main:
            integrity.write_atomically(self.run_dir / "config.toml", self.config.to_toml().encode())
            first_step = self.step + 1 if self.step else 0
            report = Report(train.report_to, self.run_dir, self.config.to_dict(), first_step)

        def log(record: dict) -> None:
            metrics.write(record)
            if report is not None:
                report.write(record)

        val_losses = [r["val_loss"] for r in read_metrics(metrics.path) if r.get("val_loss") is not None]
        if self.step == 0:
            val_losses.append(self.evaluate())
            log({"step": 0, "val_loss": val_losses[-1]})
            self._flush_notes(self._say)
            self._say(f"step 0: validation loss {val_losses[-1]:.4f}")
        progress = Progress(train.steps, self.step, train.log_every, self.stream)

        started = time.perf_counter()
        tokens_per_step = train.global_batch * train.seq_len
        try:
            gc.collect()
            gc.disable()  # collected by hand below, every GC_EVERY steps
            while self.step < train.steps:
                if self.step % GC_EVERY == 0:
                    gc.collect(1)
                t0 = time.perf_counter()
                record = {"step": self.step + 1, **self.train_step()}
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds = time.perf_counter() - t0
                record["tokens_per_s"] = tokens_per_step / seconds
                record["max_memory_bytes"] = _max_memory_bytes(self.device)
                if self.peak_flops is not None:  # of all the GPUs, whatever each one computes
                    gpus = self.mesh.dims.world_size
                    record["mfu"] = record["tokens_per_s"] * self.flops_per_token / (self.peak_flops * gpus)
                self._flush_notes(progress.message)
                progress.update(self.step, record["loss"], record["lr"], record["tokens_per_s"], record.get("mfu"))
                self.bad_steps = self.bad_steps + 1 if record.get("skipped") else 0
                if self.bad_steps:
                    progress.message(
                        f"step {self.step}: skipped, {_non_finite(record)}: no update "
                        f"({self.bad_steps} in a row; train.max_bad_steps={train.max_bad_steps})"
                    )
                if self.bad_steps >= train.max_bad_steps:
                    log(record)
                    raise DivergedError(
                        f"step {self.step}: {_non_finite(record)}; {self.bad_steps} steps in a row without "
                        f"an update (train.max_bad_steps): the run diverged; the newest checkpoint "
                        f"is {self.checkpoint or 'none'} (a lower train.lr may help)"
                    )

                last = self.step == train.steps
                if last or (train.eval_every and self.step % train.eval_every == 0):
                    record["val_loss"] = self.evaluate()
                    val_losses.append(record["val_loss"])
                    self._flush_notes(progress.message)
                    progress.message(f"step {self.step}: validation loss {record['val_loss']:.4f}")
                log(record)
                if train.save_every >= 0 and (last or (train.save_every and self.step % train.save_every == 0)):
                    prune_checkpoints(self.run_dir, train.keep_checkpoints, self.save())
        finally:
            gc.enable()
            progress.close()
            metrics.close()
            if report is not None:
                report.close()

        seconds = time.perf_counter() - started
        records = read_metrics(metrics.path)
        if self.is_main:
            plot_losses(records, self.run_dir / "loss.png", title=f"{self.config.model.model_type} · {self.run_dir}")
        if val_losses:
            saved = self.checkpoint or "none (train.save_every=-1)"
            self._say(
                f"done in {format_duration(seconds)}: validation loss {val_losses[0]:.4f} -> "
                f"{val_losses[-1]:.4f}; checkpoint {saved}; plot {self.run_dir / 'loss.png'}"
            )
        return TrainResult(
            self.run_dir,
            self.step,
            seconds,
            val_losses[0] if val_losses else None,
            val_losses[-1] if val_losses else None,
            self.checkpoint,
        )


def _inputs(batch: torch.Tensor | Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(input ids, labels, positions or None) of a (micro-)batch: a text window's labels are its
    tokens and its positions 0..T-1; packed rows carry theirs."""
    if isinstance(batch, Packed):
        return batch.tokens, batch.labels, batch.positions
    return batch, batch, None


def _label_share(micro_batches: list[torch.Tensor] | list[Packed]) -> float:
    """The step's labelled tokens over its micro-batches: each micro-batch's loss, a mean over its
    own, weighs its labelled tokens / this, so the step's loss is the mean over all of them (the
    micro-batches of text windows hold equally many: each weighs 1)."""
    return sum(label_tokens(labels_of(batch)) for batch in micro_batches) / len(micro_batches)


def _non_finite(record: dict) -> str:
    """What is not finite in a skipped step's record: "loss nan and gradient norm nan", ..."""
    names = {"loss": "loss", "grad_norm": "gradient norm"}
    return " and ".join(f"{names[key]} {record[key]}" for key in names if not math.isfinite(record[key]))


def train(config: RunConfig, stream: TextIO | None = None) -> TrainResult:
    trainer = None
    config = resolve_device(config)
    try:
        with cpu_threads(torch.device(config.train.device), config.train.threads) as threads:
            trainer = Trainer(config, stream, threads)
            return trainer.run()
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():  # launched by torchrun: leave the process group cleanly
            dist.destroy_process_group()
