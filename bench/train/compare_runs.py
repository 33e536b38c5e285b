"""Per-step training loss of two runs side by side, with the largest relative difference and the
difference of the mean loss over the last quarter of the steps.

    python3 bench/train/compare_runs.py RUN_DIR_A RUN_DIR_B [--tolerance 0.03] [--plot FILE.png --labels A B]

Exits with status 1 when a step differs by more than the tolerance (or the runs have different
steps), so a script can use it as a check. In bf16 on a GPU, two runs of the same code on one GPU
already drift apart step by step (atomics in the backward make them nondeterministic): measured
on an H200, up to 1.6e-2 by step 30 of configs/gpu_small.toml, so a tolerance must sit above that."""

from __future__ import annotations

import argparse
import sys

from moemesh.train.metrics import METRICS_FILE, read_metrics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--tolerance", type=float, default=0.03)
    parser.add_argument("--plot", help="draw both runs' training and validation losses into this image")
    parser.add_argument("--labels", nargs=2, default=["A", "B"])
    args = parser.parse_args()
    if args.plot:
        plot(args)
    runs = [{r["step"]: r for r in read_metrics(f"{d}/{METRICS_FILE}") if "loss" in r} for d in (args.a, args.b)]
    if not runs[0] or runs[0].keys() != runs[1].keys():
        print(f"the runs have different steps: {sorted(runs[0])} vs {sorted(runs[1])}")
        return 1
    worst = 0.0
    print(f"{'step':>5} {'loss A':>10} {'loss B':>10} {'rel diff':>10} {'tok/s A':>10} {'tok/s B':>10}")
    for step in sorted(runs[0]):
        a, b = runs[0][step], runs[1][step]
        diff = abs(a["loss"] - b["loss"]) / abs(a["loss"])
        worst = max(worst, diff)
        print(
            f"{step:>5} {a['loss']:>10.4f} {b['loss']:>10.4f} {diff:>10.2e} "
            f"{a['tokens_per_s']:>10.0f} {b['tokens_per_s']:>10.0f}"
        )
    tail = sorted(runs[0])[-max(1, len(runs[0]) // 4) :]
    means = [sum(run[step]["loss"] for step in tail) / len(tail) for run in runs]
    print(
        f"mean loss over steps {tail[0]}-{tail[-1]}: {means[0]:.4f} vs {means[1]:.4f} "
        f"({abs(means[0] - means[1]) / means[0]:.2e} relative)"
    )
    print(f"largest relative loss difference {worst:.2e} (tolerance {args.tolerance})")
    return 0 if worst <= args.tolerance else 1


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")  # draw to a file; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run_dir, label, color in zip((args.a, args.b), args.labels, ("tab:blue", "tab:orange")):
        records = read_metrics(f"{run_dir}/{METRICS_FILE}")
        train = [(r["step"], r["loss"]) for r in records if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
        ax.plot(*zip(*train), color=color, linewidth=1, alpha=0.8, label=f"{label}: training loss")
        ax.plot(*zip(*val), color=color, marker="o", linestyle="--", label=f"{label}: validation loss")
    ax.set(xlabel="step", ylabel="cross-entropy (nats per token)", yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
