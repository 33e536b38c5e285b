"""The scalars of metrics.jsonl, step by step, also in TensorBoard and Weights & Biases, the tools
runs are watched in (`train.report_to = ["tensorboard", "wandb"]`): every number of each record
(loss, aux_loss, lr, grad_norm, tokens_per_s, mfu, max_memory_bytes, val_loss, the expert-load
statistics, skipped as 1), under the same names, at the record's step. Only the main rank writes.

    tensorboard  event files in <run_dir>/tensorboard (`tensorboard --logdir <run_dir>/tensorboard`);
                 TensorBoard keeps scalars in float32
    wandb        <run_dir>/wandb, project $WANDB_PROJECT (default "moemesh"), the run named after the
                 run directory; offline unless the user set WANDB_MODE (a machine that trains is
                 often offline): `wandb sync <run_dir>/wandb/offline-run-*` uploads a run afterwards

Both are optional dependencies (`pip install 'moemesh[tracking]'`); the run config refuses a name
whose package is missing when it is read (`config.REPORT_TO`), before any model is built.

Limits: a resumed run writes again the steps past its checkpoint. TensorBoard hides the earlier
ones (`purge_step`); W&B gets a new run, grouped by the run directory's name, that starts there.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any


class Report:
    """The writers `names` asks for; `first_step`: the first step this process writes (0 for a
    new run, the checkpoint's step + 1 for a resumed one)."""

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any], first_step: int):
        self.tensorboard = self.wandb = None
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard drops what earlier event files hold from this step on.
            self.tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)
        if "wandb" in names:
            import wandb

            self.wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "moemesh"),
                name=run_dir.name,
                group=run_dir.name,  # a resumed run is a new W&B run of the same group
                dir=str(run_dir),
                config=config,
                mode=None if "WANDB_MODE" in os.environ else "offline",
            )

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        # As metrics.jsonl, which writes a non-finite value (a skipped step's loss) as null.
        scalars = {k: float(v) for k, v in record.items() if k != "step" and _is_number(v) and math.isfinite(v)}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()  # as metrics.jsonl: a crash loses no step written
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool too: skipped -> 1.0
