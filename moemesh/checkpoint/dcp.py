"""Checkpoints written with torch.distributed.checkpoint (DCP), so that later parallel layouts
save their shards in parallel and load them back into any other layout.

    run_dir/checkpoints/step_N/
        .metadata, __*_*.distcp   DCP: model, optimizer, scheduler, trainer state (step, data
                                  position, RNG states); a converted model holds "model" only.
                                  Tensors are stored whole, as `parallel/stored.py` presents them
                                  (gate_up_proj as its .gate and .up halves), whatever the layout
        config.json               the model config, in Hugging Face field names
        tokenizer.json            the tokenizer, when the run used one (none: byte-level), with its
                                  tokenizer_config.json, chat_template.jinja, special_tokens_map.json
        SHA256SUMS                the checksum of every other file (`integrity.py`)

A checkpoint is written under a temporary name, flushed to disk, and renamed to `step_N` only when
complete, so a `step_N` directory is never half-written and an interrupted save leaves the previous
one intact. Before a checkpoint is used it is verified (`integrity.problem`); asked for the newest
one of a run directory, `latest_checkpoint` passes over those that fail, saying which and why.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from moemesh.checkpoint import integrity
from moemesh.errors import CheckpointError
from moemesh.models import ModelConfig
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.stored import stored_state

CHECKPOINTS = "checkpoints"
TOKENIZER_FILE = "tokenizer.json"
# What travels with a tokenizer.json, from the directory it came from: its special tokens and chat
# template, so that a fine-tuned or converted model chats as its source did.
TOKENIZER_COMPANIONS = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_path(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step_{step}"


def checkpoint_steps(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, directory) of every `step_N` of `run_dir`, newest first, whether it verifies or not."""
    root = Path(run_dir) / CHECKPOINTS
    steps = [(int(m.group(1)), p) for p in root.glob("step_*") if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps, reverse=True)


def latest_checkpoint(run_dir: str | os.PathLike, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest checkpoint of `run_dir` that verifies, or None. Each newer one that does not is
    named in one line, with why, to `report` (default: standard error, from the main rank).
    Collective under a process group: every rank calls it and gets the same answer."""
    for _, path in checkpoint_steps(run_dir):
        problem = integrity.problem(path)
        if problem is None:
            return path
        (report or _report_on_stderr)(f"skipping {path}, which {problem}")
    return None


def prune_checkpoints(run_dir: str | os.PathLike, keep: int, saved: Path) -> None:
    """After `saved` was written: delete the checkpoints older than it but the newest `keep` - 1,
    and what interrupted saves left behind. `saved`, just written and hashed, is the newest
    checkpoint known to verify and always stays; newer ones (a run resumed from an older checkpoint
    when the newer ones failed to verify) are left for the run to replace. keep 0 keeps all."""
    if keep == 0 or not _is_main():
        return
    older = [path for step, path in checkpoint_steps(run_dir) if path != saved and step < _step_of(saved)]
    for path in older[keep - 1 :]:
        integrity.remove(path)
    for leftover in (Path(run_dir) / CHECKPOINTS).glob(integrity.TMP_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _report_on_stderr(line: str) -> None:
    if _is_main():
        print(f"moemesh: {line}", file=sys.stderr, flush=True)


def _is_main() -> bool:
    return _no_dist() or dist.get_rank() == 0


def tokenizer_files(tokenizer_file: str | os.PathLike | None) -> dict[str, Path]:
    """{name in a checkpoint or model directory: file} for a tokenizer.json (whatever its own name)
    and the companions beside it; {} for None (the byte tokenizer)."""
    if tokenizer_file is None:
        return {}
    source = Path(tokenizer_file)
    companions = {name: source.parent / name for name in TOKENIZER_COMPANIONS}
    return {TOKENIZER_FILE: source, **{name: path for name, path in companions.items() if path.is_file()}}


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


def save_checkpoint(
    path: Path,
    state: dict[str, Any],
    model_config: ModelConfig,
    tokenizer_file: str | os.PathLike | None = None,
    model: nn.Module | None = None,
    mesh: Mesh | None = None,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """Write `state` (nested dicts of tensors and small Python values; the parts of `model` on
    `mesh` where it is sharded) with DCP as `stored_state` presents it, plus config.json (and
    tokenizer.json, and `extra_files`: name -> bytes, such as a LoRA run's lora.json) and
    SHA256SUMS, all under a temporary name and flushed to disk, then rename to `path`. A failure
    on any rank (no space left, no permission) raises CheckpointError on every rank and leaves
    nothing behind."""
    tmp = path.with_name(integrity.TMP_PREFIX + path.name)
    extra_files = extra_files or {}

    def prepare():
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
        tmp.mkdir(parents=True)
        integrity.write_durably(tmp / "config.json", (json.dumps(model_config.to_hf_dict(), indent=2) + "\n").encode())
        for name, file in tokenizer_files(tokenizer_file).items():
            integrity.write_durably(tmp / name, file.read_bytes())
        for name, content in extra_files.items():
            integrity.write_durably(tmp / name, content)

    _on_main_rank(prepare, path, tmp)
    # DCP's writer fsyncs each file and .metadata. One writing thread per rank: with more, a thread
    # that fails dies unseen and DCP publishes metadata without its tensors (torch 2.13).
    try:
        with _single_process_quietly():  # every rank writes its part; a failure anywhere raises on all
            metadata = dcp.save(stored_state(state, model, mesh), checkpoint_id=tmp, no_dist=_no_dist())
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        if _is_main():
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {path}: {_first_cause(e)}") from None
    if metadata is None or not metadata.storage_data:  # torch 2.11 returns it without: every rank reads it
        metadata = dcp.FileSystemReader(tmp).read_metadata()
    names = {item.relative_path for item in metadata.storage_data.values()} | {".metadata", "config.json"}
    names |= set(tokenizer_files(tokenizer_file))
    names |= set(extra_files)
    digests = integrity.sha256_of_files(tmp, sorted(names))
    unreadable = sorted(name for name, digest in digests.items() if digest is None)

    def publish():
        if unreadable:
            raise OSError(f"{unreadable[0]} cannot be read back")
        integrity.write_checksums(tmp, digests)
        integrity.publish(tmp, path)

    _on_main_rank(publish, path, tmp)


def _on_main_rank(action: Callable[[], None], path: Path, tmp: Path) -> None:
    """Run `action` (file work) on the main rank; if it fails, remove `tmp` and raise
    CheckpointError on every rank (a barrier too)."""
    error = None
    if _is_main():
        try:
            action()
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = e.strerror if e.strerror else str(e)
    error = comm.all_gather_object(error)[0]
    if error is not None:
        raise CheckpointError(f"cannot write checkpoint {path}: {error}")


def _first_cause(error: BaseException) -> str:
    """What went wrong, in one line. DCP wraps each rank's exception in a CheckpointException; the
    one that matters is often earlier in its chain: "OSError: [Errno 28] No space left on device",
    not what torch.save raised while closing the file after it."""
    if isinstance(error, dcp.CheckpointException) and error.failures:
        failure = next(iter(error.failures.values()))  # the first rank's (exception, traceback)
        error = failure[0] if isinstance(failure, tuple) else failure
    chain = [error]
    while (earlier := chain[-1].__cause__ or chain[-1].__context__) is not None and earlier not in chain:
        chain.append(earlier)
    cause = next((e for e in reversed(chain) if isinstance(e, OSError)), error)
    return f"{type(cause).__name__}: {cause}"


def training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer: dict[str, Any],
    trainable_only: bool = False,
) -> dict[str, Any]:
    """What a training checkpoint holds (this rank's part of it). `trainable_only` (LoRA): of the
    model, the parameters that train and the buffers, not the frozen base."""
    options = StateDictOptions(ignore_frozen_params=trainable_only)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    return {"model": model_state, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "trainer": trainer}


def load_training_state(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer: dict[str, Any],
    mesh: Mesh | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restore model, optimizer and scheduler from the checkpoint `path` (one that
    `latest_checkpoint` or `resolve_checkpoint` found to verify) into this rank of `mesh`; returns
    `trainer` filled from it (a key that a checkpoint of an older moemesh lacks keeps its value).
    `trainable_only`: as it was saved (LoRA: the frozen base stays)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    trainer = {k: v for k, v in trainer.items() if f"trainer.{k}" in saved}
    state = training_state(model, optimizer, scheduler, trainer, trainable_only)
    # The parameter groups stay this rank's own, as the config built them: a checkpoint holds one
    # rank's groups, naming that rank's parameters only (under a pipeline, other ranks hold
    # others), so they cannot say which group another rank's parameter is in. The learning rate,
    # the one value of a group that changes during a run, comes from the scheduler.
    own_groups = copy.deepcopy(state["optimizer"]["param_groups"])
    stored = stored_state(state, model, mesh)
    _load(path, stored)  # tensors in place, so into `state` too; Python values into `stored` only
    state["optimizer"]["param_groups"] = own_groups  # (the load wrote the saved ones into the old lists)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        # The frozen base is not in the state (DCP has already checked that the rest is complete).
        options=StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only),
    )
    scheduler.load_state_dict(stored["scheduler"])
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
        group["lr"] = lr
    return {**trainer, **stored["trainer"]}


def _load(path: Path, state: dict[str, Any]) -> None:
    """Read a verified checkpoint into `state` (verified once only: verifying reads every byte)."""
    try:
        with _single_process_quietly():
            dcp.load(state, checkpoint_id=path, no_dist=_no_dist())
    except (Exception, dcp.CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot load checkpoint {path}: {_first_cause(e)}") from None


def check_complete(path: Path) -> None:
    """Raise CheckpointError unless `path` holds a DCP checkpoint that verifies (`integrity.problem`)."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    problem = integrity.problem(path)
    if problem is not None:
        raise CheckpointError(f"{path} {problem}")


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the newest one of a run directory, that verifies."""
    path = Path(path)
    if (path / CHECKPOINTS).is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"no complete checkpoint in {path / CHECKPOINTS}")
        return latest
    check_complete(path)
    return path
