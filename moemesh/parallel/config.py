"""What a parallel layout is made of: the sizes of its dimensions and how its pipeline and FSDP run
(`ParallelConfig`, the run config's [parallel] section), and what of a training step it depends on
(`StepShape`). The run config (`moemesh/config.py`) reads and checks them; `parallelize` and the
pipeline memory model take them, and nothing else of the run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    """Sizes of the parallel dimensions, the pipeline schedule, and how FSDP runs."""

    dp_replicate: int = 1  # data-parallel replicas (with dp_shard > 1: HSDP)
    dp_shard: int = 1  # FSDP: weights, gradients and optimizer state split over these ranks
    ep: int = 1  # expert-parallel size: each rank holds num_experts / ep experts
    tp: int = 1  # tensor-parallel size: heads, vocabulary and MLP/expert widths split tp ways
    pp: int = 1  # pipeline-parallel ranks
    # How tokens reach their experts under ep > 1 (`expert.py`): "gather" queues the step without
    # waiting for the host; "all_to_all" sends exact splits, the host waiting once per MoE layer.
    ep_dispatch: str = "gather"
    # "gather"'s expert buffer at the start, in mean rows a rank (tokens × top-k): a step that needs
    # more is computed again with a larger buffer (`expert.fit_capacity`), never with tokens dropped.
    ep_capacity: float = 1.25
    pp_schedule: str = "dualpipev"  # or "1f1b"; train.global_batch / train.micro_batch micro-batches
    # Under EP, a forward's compute hides a backward's EP collectives, and vice versa: DualPipeV's
    # paired chunks, or without a pipeline each next micro-batch's forward beside this one's
    # backward (pipeline/schedule.paired). Off by default: on H200s (6-layer Qwen3-30B-A3B shape,
    # 2026-11-27) 1.14× faster under DualPipeV (pp=2 × ep=2), 1.03-1.04× with train.cuda_graphs
    # under ep=2 and ep=4, 0.94-1.16× without them (docs/benchmarks.md).
    pp_overlap: bool = False
    fsdp_reshard_after_forward: bool = True  # free gathered weights after forward (less memory)
    fsdp_prefetch: bool = True  # gather the next block's weights during this block's compute
    timeout_s: float = 300.0  # a collective that waits longer for a peer fails (a peer stopped, hung or died)

    @property
    def batch_ranks(self) -> int:
        """Ranks that take different slices of each micro-batch: the data-parallel and the
        expert-parallel ones (experts split over ep, the dense part data-parallel over all)."""
        return self.dp_replicate * self.dp_shard * self.ep

    @property
    def world_size(self) -> int:
        return self.batch_ranks * self.tp * self.pp


@dataclass(frozen=True)
class StepShape:
    """What a layout depends on of a training step (the [train] keys of these names): the pipeline
    schedules `micro_batches` micro-batches of `micro_batch` sequences (summed over the data-parallel
    ranks) of `seq_len` tokens, its stages partitioned by their memory; FSDP gathers the weights in
    `dtype`, the compute dtype; weights and AdamW state are kept in `param_dtype`; decoder layers
    recompute their activations in backward by `activation_checkpointing`. The defaults, one
    token in float32, suit a layout without a pipeline (generation), where only `dtype` counts."""

    micro_batches: int = 1
    micro_batch: int = 1
    seq_len: int = 1
    dtype: str = "float32"  # "float32" or "bfloat16" ("auto" resolved)
    param_dtype: str = "float32"
    activation_checkpointing: str = "none"  # "full" or "selective" (ops/recompute.py)
    frozen_base: bool = False  # LoRA: the base keeps its weight alone (no gradient, no AdamW state)
    quantized_base: str = ""  # LoRA on a quantized base kept so: "fp8" or "mxfp4" (its weights' bytes)
    whole_step: bool = False  # train.cuda_graphs: the step is captured as one CUDA graph
