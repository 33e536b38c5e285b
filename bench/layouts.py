"""One run config under several parallel layouts of the same processes, side by side:

    PYTHONPATH=. torchrun --nproc-per-node 4 bench/layouts.py --layouts "pp=2,ep=2;ep=2,tp=2;dp_shard=2,ep=2"
    PYTHONPATH=. torchrun --nproc-per-node 8 bench/layouts.py --layouts "pp=2,ep=2,tp=2;pp=2,dp_shard=2,ep=2"
    PYTHONPATH=. python3 bench/layouts.py --layouts ""     (the one-process reference of the same steps)
    PYTHONPATH=. torchrun --nproc-per-node 4 bench/layouts.py --config configs/tiny.toml --steps 5 \\
        --set train.seq_len=64 --layouts "pp=2,ep=2;ep=2,tp=2;dp_shard=2,ep=2"     (CPU, gloo)

Each layout trains `--steps` steps of the same global batch from the same initial weights (the
trainer's own step); the table gives the loss after the last step, the largest relative difference
of any step's loss from the first layout's, tokens/s, MFU and the peak memory of the busiest GPU.
Layouts are `;`-separated lists of `axis=size` over the `parallel.*` keys; the sizes of each must
multiply to the number of processes. With `--reference FILE` (the `--save` of another run, e.g. one
GPU) the losses are compared to that run's instead.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch
import torch.distributed as dist

from bench.common import print_table
from moemesh.config import load_config
from moemesh.train.trainer import Trainer

WORLD = int(os.environ.get("WORLD_SIZE", "1"))


def run_layout(layout: str, args) -> tuple[dict, list[float]]:
    sizes = [f"parallel.{item}" for item in layout.split(",") if item]
    config = load_config(args.config, [*args.set, f"train.steps={args.steps}", *sizes])
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        record = trainer.train_step()  # returns plain numbers: the step has finished on the device
        times.append(time.perf_counter() - start)
        losses.append(record["loss"])
    tokens = config.train.global_batch * config.train.seq_len
    step_s = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # median, the first step aside
    row = {"layout": layout or "one process", "loss": f"{losses[-1]:.4f}", "tokens/s": f"{tokens / step_s:,.0f}"}
    if trainer.peak_flops is not None:
        row["MFU"] = f"{tokens / step_s * trainer.flops_per_token / (trainer.peak_flops * WORLD):.1%}"
        peak = torch.tensor(torch.cuda.max_memory_allocated(trainer.device) / 2**30, device=trainer.device)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        row["peak GiB/GPU"] = f"{peak.item():.1f}"
    return row, losses


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_small.toml")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every layout")
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save", help="write the first layout's per-step losses to this JSON file")
    parser.add_argument("--reference", help="compare losses with a --save file instead of the first layout")
    args = parser.parse_args()
    rows, curves = [], []
    for layout in args.layouts.split(";"):
        row, losses = run_layout(layout, args)
        rows.append(row)
        curves.append(losses)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    main_rank = not dist.is_initialized() or dist.get_rank() == 0
    reference = json.load(open(args.reference)) if args.reference else curves[0]
    for row, losses in zip(rows, curves):
        row["max rel. loss diff"] = f"{max(abs(a - b) / abs(b) for a, b in zip(losses, reference)):.1e}"
    if main_rank:
        if args.save:
            json.dump(curves[0], open(args.save, "w"))
        print_table(rows, f"{args.config}, {args.steps} steps, {WORLD} processes")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
