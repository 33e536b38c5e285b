"""loss.png: training and validation loss against the step."""

from __future__ import annotations

import os
from typing import Any


def plot_losses(records: list[dict[str, Any]], path: str | os.PathLike, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # draw to a file; no display needed
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), color="tab:blue", alpha=0.8, linewidth=1, label="train loss")
    if val:
        ax.plot(*zip(*val), color="tab:orange", marker="o", markersize=4, linewidth=1.5, label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
