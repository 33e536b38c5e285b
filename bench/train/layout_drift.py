"""How far each parallel layout's loss curve strays from one process's over a whole run, beside
the noise floor, and whether the step itself is the same:

    PYTHONPATH=. python3 bench/train/layout_drift.py                       (configs/tiny.toml, 60 steps, CPU)
    PYTHONPATH=. python3 bench/train/layout_drift.py --steps 60 --layouts "dp_replicate=2;ep=2;tp=2;dp_shard=2" \\
        --plot docs/img/layout_drift.png

Every run is `moemesh train` with one thread per process (torchrun for a layout), from the same
seed and data. The reference is one process; the noise floor is the same process on two threads
(the same arithmetic, summed in another order). The first table gives |loss − one process| at
some steps of each free-running curve; the plot draws it for every step. Training is chaotic: a
rounding difference stays near 1e-7 for a dozen steps, then a router's top-k choice flips for a
token near a tie and the curves part by ~1e-3. The second table takes the chaos out: each layout
resumes from the reference's checkpoints at `--forced` steps and takes one step, whose loss and
gradient norm (and, in the tests, every weight and AdamW moment after it) must be one process's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import ROOT, print_table


def launcher(layout: str) -> list[str]:
    processes = 1
    for item in layout.split(",") if layout else []:
        processes *= int(item.partition("=")[2])
    return (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
        if processes > 1
        else [sys.executable]
    )


def execute(command: list[str], threads: int = 1) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return result.stdout


def sizes(layout: str) -> list[str]:
    return [f"parallel.{item}" for item in layout.split(",") if item]


def train(run_dir: Path, args, layout: str = "", threads: int = 1, extra: tuple[str, ...] = ()) -> list[dict]:
    """`moemesh train` in `layout`: its per-step records."""
    execute(
        [
            *launcher(layout),
            "-m",
            "moemesh",
            "train",
            "--config",
            args.config,
            "--set",
            *args.set,
            f"train.steps={args.steps}",
            "train.device=cpu",
            "train.eval_every=0",
            f"train.run_dir={run_dir}",
            *sizes(layout),
            *extra,
        ],
        threads,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def run(args, layout: str, *worker_args: str) -> str:
    """This script in worker mode, in `layout`."""
    return execute(
        [
            *launcher(layout),
            __file__,
            "--config",
            args.config,
            "--steps",
            str(args.steps),
            "--set",
            *args.set,
            *worker_args,
            "--layout-set",
            *sizes(layout),
        ]
    )


def one_step(args) -> None:
    """(torchrun worker) One step of the trainer in this layout from `--from-checkpoint`; rank 0
    prints its record as JSON."""
    import torch.distributed as dist

    from moemesh.config import load_config
    from moemesh.train.trainer import Trainer

    config = load_config(
        args.config,
        [*args.set, f"train.steps={args.steps}", "train.device=cpu", f"train.run_dir={args.run_dir}", *args.layout_set],
    )
    trainer = Trainer(config, stream=open(os.devnull, "w"))
    trainer.restore(Path(args.from_checkpoint))
    record = trainer.train_step()
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(record))
    if dist.is_initialized():
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny.toml"))
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layouts", default="dp_replicate=2;ep=2;tp=2;dp_shard=2")
    parser.add_argument("--at", default="10,15,18,20,30,40,60", help="steps the first table shows")
    parser.add_argument(
        "--forced-every",
        type=int,
        default=15,
        help="each layout takes one step from one process's checkpoint every this many steps",
    )
    parser.add_argument("--plot", help="draw |loss − one process| per step into this PNG")
    parser.add_argument("--from-checkpoint", help=argparse.SUPPRESS)  # worker mode (one_step)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--layout-set", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.from_checkpoint:
        return one_step(args)
    layouts = [layout for layout in args.layouts.split(";") if layout]
    work = Path(tempfile.mkdtemp(prefix="layout_drift-"))

    reference = train(
        work / "one-process", args, extra=(f"train.save_every={args.forced_every}", "train.keep_checkpoints=0")
    )  # each is forced from
    curves = {
        "one process, 2 threads (noise floor)": train(
            work / "two-threads", args, threads=2, extra=("train.save_every=-1",)
        )
    }
    for layout in layouts:
        curves[layout] = train(work / layout, args, layout, extra=("train.save_every=-1",))
    at = [s for s in (int(s) for s in args.at.split(",")) if s <= args.steps]
    rows = [
        {"run": name, **{f"step {s}": f"{abs(curve[s - 1]['loss'] - reference[s - 1]['loss']):.1e}" for s in at}}
        for name, curve in curves.items()
    ]
    print_table(rows, f"|loss − one process| of free-running curves ({args.config}, {args.steps} steps)")

    forced_rows = []
    for step in range(args.forced_every, args.steps, args.forced_every):
        checkpoint = work / "one-process" / "checkpoints" / f"step_{step}"
        for layout in ["", *layouts]:
            record = json.loads(
                run(
                    args,
                    layout,
                    "--from-checkpoint",
                    str(checkpoint),
                    "--run-dir",
                    str(work / f"{layout or 'one-process'}-from-{step}"),
                ).splitlines()[-1]
            )
            expected = reference[step]  # the record of step + 1
            forced_rows.append(
                {
                    "layout": layout or "one process",
                    "from step": step,
                    **{
                        f"{key} rel. diff": f"{abs(record[key] - expected[key]) / expected[key]:.1e}"
                        for key in ("loss", "grad_norm")
                    },
                }
            )
    print_table(forced_rows, "one step from one process's checkpoint: relative difference from one process's step")
    if args.plot:
        plot(reference, curves, args.plot)
    shutil.rmtree(work, ignore_errors=True)


def plot(reference: list[dict], curves: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        steps = [r["step"] for r in curve]
        diffs = [max(abs(a["loss"] - b["loss"]), 1e-8) for a, b in zip(curve, reference)]
        style = dict(color="black", linewidth=2.5, alpha=0.5) if "noise" in name else dict(linewidth=1.2)
        ax.plot(steps, diffs, label=name, **style)
    ax.set(xlabel="step", ylabel="|loss − one process| (1e-8: equal)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
