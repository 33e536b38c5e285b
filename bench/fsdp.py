"""FSDP (dp_shard) against plain data parallelism on the same GPUs, through the trainer's own step
(forward, backward, gradient reduction, clipping, AdamW):

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/fsdp.py [--layers 8] [--seq 4096] [--sequences 2]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/fsdp.py --config configs/tiny.toml --seq 256   (CPU smoke)

A Qwen3-30B-A3B-shaped model (hidden 2048, 128 experts top-8, expert width 768, 32/4 heads,
vocabulary 151,936) cut to --layers layers, bf16 compute, fp32 weights and AdamW state. Variants:
replicated (dp_replicate: every GPU holds everything, gradients all-reduced), FSDP with explicit
prefetch (the default), FSDP without it (FSDP2's own order: a block's all-gather is issued when
the block starts), FSDP keeping gathered weights from forward to backward. For each: step time,
tokens/s, peak memory per GPU (after setup), and from a profiled step the time in NCCL kernels and
the share of it that ran while a compute kernel was running too.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist

from bench.common import intersection_length, interval_length, kernel_intervals, median_ms, print_table, qwen3_30b_a3b
from moemesh.config import DataConfig, ParallelConfig, RunConfig, TrainConfig, load_config
from moemesh.train.trainer import Trainer

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
VARIANTS = {  # the replicated one last: it is the one that may run out of memory
    "fsdp": dict(dp_shard=WORLD),
    "fsdp-no-prefetch": dict(dp_shard=WORLD, fsdp_prefetch=False),
    "fsdp-keep-after-forward": dict(dp_shard=WORLD, fsdp_reshard_after_forward=False),
    "replicated": dict(dp_replicate=WORLD),
}


def comm_overlap(trainer: Trainer) -> tuple[float, float]:
    """Profile one step: (ms in NCCL kernels, fraction of it overlapped by compute kernels)."""
    nccl, compute = kernel_intervals(trainer.train_step)
    comm_us = interval_length(nccl)
    return comm_us / 1e3, (intersection_length(nccl, compute) / comm_us if comm_us else 0.0)


def run_variant(name: str, parallel: dict, args) -> dict:
    world = WORLD
    model = (
        load_config(args.config, [f"parallel.dp_shard={WORLD}"]).model if args.config else qwen3_30b_a3b(args.layers)
    )
    config = RunConfig(
        model=model,
        parallel=ParallelConfig(**parallel),
        train=TrainConfig(
            global_batch=args.sequences * world,
            micro_batch=args.sequences * world,
            seq_len=args.seq,
            eval_sequences=world,
            run_dir="/tmp/bench_fsdp",
            warmup_steps=1,
            steps=100,
        ),
        data=DataConfig(),
    )
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    records = []
    on_gpu = trainer.device.type == "cuda"
    if on_gpu:
        trainer.train_step()  # the first step allocates the optimizer state: part of the peak
        torch.cuda.reset_peak_memory_stats()  # the whole model built on each GPU before sharding is not
    step_ms = median_ms(lambda: records.append(trainer.train_step()), warmup=args.warmup, repeat=args.steps)
    tokens = args.sequences * world * args.seq
    row = {
        "variant": name,
        "layout": " ".join(f"{k}={v}" for k, v in parallel.items()),
        "step ms": f"{step_ms:.0f}",
        "tokens/s": f"{tokens / step_ms * 1e3:,.0f}",
        "loss": f"{records[-1]['loss']:.4f}",
    }
    if on_gpu:
        peak = torch.tensor(torch.cuda.max_memory_allocated(trainer.device) / 2**30, device=trainer.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        comm_ms, overlapped = comm_overlap(trainer)
        row.update(
            {
                "peak GiB/GPU": f"{peak.item():.1f}",
                "NCCL ms/step": f"{comm_ms:.0f}",
                "NCCL overlapped": f"{overlapped:.0%}",
            }
        )
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument(
        "--config", help="take the model from this run config instead (configs/tiny.toml: a CPU smoke run)"
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=2, help="sequences per GPU per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names to run")
    args = parser.parse_args()
    rows = []
    for name in args.variants.split(","):
        try:
            rows.append(run_variant(name, VARIANTS[name], args))
        except torch.OutOfMemoryError:
            rows.append({"variant": name, "step ms": "out of memory"})
        gc.collect()  # the variant's model and optimizer state, before the next one
        torch.cuda.empty_cache()
        if dist.get_rank() == 0:
            print(rows[-1], flush=True)
    if dist.get_rank() == 0:
        rows = [{key: row.get(key, "") for key in max(rows, key=len)} for row in rows]
        model = args.config or f"{args.layers}-layer Qwen3-30B-A3B shape"
        print_table(rows, f"FSDP vs replicated, {model}, {args.sequences}×{args.seq} tokens per GPU, {WORLD} GPUs")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
