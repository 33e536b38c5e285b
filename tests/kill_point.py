"""Run the `moemesh` command and kill this very process with SIGKILL, as `kill -9` would, at an exact
point of training or saving (an outside `kill -9` lands wherever the clock says; this one lands
where the test says, so a seeded choice of points is the same run every time):

    python tests/kill_point.py POINT N train --config FILE --set ...

dies the N-th time this process reaches POINT:
    step        an optimizer step starts
    metrics     a step's record has just been written to metrics.jsonl
    dcp_data    DCP has written a checkpoint's data files, not yet its .metadata
    checksums   a checkpoint is complete under its temporary name, without SHA256SUMS
    publish     SHA256SUMS is written; the rename that publishes the checkpoint is not done
    published   the checkpoint is published; older ones are not pruned yet
    prune       an older checkpoint is renamed aside for deletion, not yet deleted
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

from moemesh.checkpoint import integrity
from moemesh.cli import main
from moemesh.train.metrics import MetricsLog
from moemesh.train.trainer import Trainer


def _patch(owner, name: str, point: str, chosen: str, nth: int, after: bool = False, only=lambda *a: True):
    """Make owner.name SIGKILL the process the nth time it is called (and `only` accepts the call)
    when `point` is the chosen one."""
    if point != chosen:
        return
    real, calls = getattr(owner, name), [0]

    def wrapper(*args, **kwargs):
        if not only(*args):
            return real(*args, **kwargs)
        calls[0] += 1
        if calls[0] == nth and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = real(*args, **kwargs)
        if calls[0] == nth and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapper)


def install(point: str, nth: int) -> None:
    _patch(Trainer, "train_step", "step", point, nth)
    _patch(MetricsLog, "write", "metrics", point, nth, after=True)
    _patch(dcp.FileSystemWriter, "finish", "dcp_data", point, nth)
    _patch(integrity, "write_checksums", "checksums", point, nth)
    _patch(integrity, "publish", "publish", point, nth)
    _patch(integrity, "publish", "published", point, nth, after=True)
    # integrity.remove renames the doomed directory to .tmp-deleting-<name>, then deletes it
    _patch(
        shutil,
        "rmtree",
        "prune",
        point,
        nth,
        only=lambda path, *rest: Path(path).name.startswith(".tmp-deleting-") and Path(path).exists(),
    )


if __name__ == "__main__":
    install(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
