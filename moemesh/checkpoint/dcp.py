"""Checkpoints written with torch.distributed.checkpoint (DCP), so that later parallel layouts
save their shards in parallel and load them back into any other layout.

    run_dir/checkpoints/step_N/
        .metadata, __*_*.distcp   DCP: model, optimizer, scheduler, trainer state (step, data
                                  position, RNG states); a converted model holds "model" only.
                                  Tensors are stored whole, as `parallel/stored.py` presents them
                                  (gate_up_proj as its .gate and .up halves), whatever the layout
        config.json               the model config, in Hugging Face field names
        tokenizer.json            the tokenizer, when the run used one (none: byte-level)

A checkpoint is written under a temporary name and renamed to `step_N` only when complete, so a
`step_N` directory is never half-written and an interrupted save leaves the previous one intact.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from moemesh.errors import CheckpointError
from moemesh.models import ModelConfig
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.stored import stored_state

CHECKPOINTS = "checkpoints"
TOKENIZER_FILE = "tokenizer.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp-"


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step}"


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step in `run_dir`, or None."""
    root = Path(run_dir) / CHECKPOINTS
    steps = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name))]
    complete = [(step, p) for step, p in steps if (p / ".metadata").is_file()]
    return max(complete)[1] if complete else None


def _is_main() -> bool:
    return _no_dist() or dist.get_rank() == 0


def _no_dist() -> bool:
    # One process without a process group saves and loads on its own; under torchrun DCP
    # coordinates the ranks.
    return not (dist.is_available() and dist.is_initialized())


@contextmanager
def _single_process_quietly():
    # DCP warns that it "assumes a single process" even when told so with no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(path: Path, state: dict[str, Any], model_config: ModelConfig,
                    tokenizer_file: str | os.PathLike | None = None, model: nn.Module | None = None,
                    mesh: Mesh | None = None) -> None:
    """Write `state` (nested dicts of tensors and small Python values; the parts of `model` on
    `mesh` where it is sharded) with DCP as `stored_state` presents it, plus config.json (and
    tokenizer.json), all under a temporary name, then rename to `path`."""
    tmp = path.with_name(_TMP_PREFIX + path.name)
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    comm.barrier()
    with _single_process_quietly():
        dcp.save(stored_state(state, model, mesh), checkpoint_id=tmp, no_dist=_no_dist())  # every rank writes its part
    if _is_main():
        (tmp / "config.json").write_text(json.dumps(model_config.to_hf_dict(), indent=2) + "\n")
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
        if path.exists():  # the same step saved again, e.g. by a resumed run
            shutil.rmtree(path)
        os.rename(tmp, path)
    comm.barrier()


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                   scheduler: torch.optim.lr_scheduler.LRScheduler, trainer: dict[str, Any]) -> dict[str, Any]:
    """What a training checkpoint holds (this rank's part of it)."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "trainer": trainer}


def load_training_state(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                        scheduler: torch.optim.lr_scheduler.LRScheduler, trainer: dict[str, Any],
                        mesh: Mesh | None = None) -> dict[str, Any]:
    """Restore model, optimizer and scheduler from `path` (into this rank of `mesh`); returns
    `trainer` filled from it."""
    state = training_state(model, optimizer, scheduler, trainer)
    # The parameter groups stay this rank's own, as the config built them: a checkpoint holds one
    # rank's groups, naming that rank's parameters only (under a pipeline, other ranks hold
    # others), so they cannot say which group another rank's parameter is in. The learning rate,
    # the one value of a group that changes during a run, comes from the scheduler.
    own_groups = copy.deepcopy(state["optimizer"]["param_groups"])
    stored = stored_state(state, model, mesh)
    _load(path, stored)  # tensors in place, so into `state` too; Python values into `stored` only
    state["optimizer"]["param_groups"] = own_groups  # (the load wrote the saved ones into the old lists)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    scheduler.load_state_dict(stored["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return stored["trainer"]


def _load(path: Path, state: dict[str, Any]) -> None:
    check_complete(path)
    try:
        with _single_process_quietly():
            dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        reason = lines[-1] if lines else type(e).__name__
        raise CheckpointError(f"cannot load checkpoint {path}: {reason}") from None


def check_complete(path: Path) -> None:
    """Raise CheckpointError unless `path` holds a readable DCP checkpoint with all its data."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no .metadata)")
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(f"{path} is not a complete checkpoint (unreadable .metadata: {e})") from None
    needed: dict[str, int] = {}
    for item in metadata.storage_data.values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in needed.items():
        file = path / name
        if not file.is_file() or file.stat().st_size < size:
            raise CheckpointError(f"{path} is not a complete checkpoint ({name} is missing or truncated)")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the newest one of a run directory."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {path / CHECKPOINTS}")
        return latest
    check_complete(path)
    return path
