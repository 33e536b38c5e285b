"""Activation checkpointing: a decoder layer keeps less for its backward and runs part of its
forward again there (`train.activation_checkpointing`).

    none       every tensor the backward needs is kept from the forward
    full       only the layer's inputs are kept (and, outside CUDA graphs, LoRA's cast factors:
               `reused`); the whole layer runs again in backward (`torch.utils.checkpoint`,
               non-reentrant), its collectives included
    selective  as Megatron's selective recomputation: the outputs of the matmuls (projections,
               the experts' grouped GEMMs) and of the collectives (all-to-alls, all-reduces) are
               kept; the cheap rest — norms, rotary, attention's core (softmax), activations,
               permutes, the router's small logits product — runs again, and no collective is
               issued twice

`kept(compute)` is how selective recomputation keeps a result: in the checkpointed forward it
computes and records it, in the recomputation it gives the recorded tensor back instead of
computing (`ops/linear.py`, `ops/grouped_mm.py`, `parallel/comm.py` call it). Only an autograd
Function may call it, in its forward: the Function still saves its inputs for backward in the same
order, so torch's checkpoint finds them. Outside a selective region `kept` just computes.

`reused(compute)` does the same in every checkpointed region, full ones too, for results whose
computation saves no tensor for backward, so that skipping it changes nothing torch's checkpoint
matches: LoRA's factors cast to the compute dtype (`models/lora.py`), made once a forward and not
again when the layer recomputes. The recomputation gets the forward's tensor, autograd history
included; its graph is dropped (torch's non-reentrant checkpoint runs the backward through the
forward's graph, the recomputation only refills saved tensors), so gradients still reach the
parameters once, through the forward's cast. While a CUDA graph is captured `reused` computes
again instead: a graph's launches are free, and the copies kept through the step are not (1.2 GiB
of bf16 factors for the LoRA recipe, `ops/low_rank.py`).

A recomputation gives bit for bit what the forward gave: the same ops on the same inputs, the
random state restored (LoRA dropout), kept tensors unchanged (checked). So gradients do not change.
What a forward does beside computing must not happen twice: `recomputing()` tells it (DeepSeek-V3's
expert loads). State is per thread: the pipeline's overlapped chunks run on two threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")

_local = threading.local()


class _Tape:
    """The results `kept` (in a selective region) and `reused` recorded in one region's forward,
    given back in order when it recomputes."""

    def __init__(self, selective: bool):
        self.selective = selective
        self.entries: list[tuple[torch.Tensor, int] | None] = []
        self.replaying = False
        self.position = 0

    def record(self, value: torch.Tensor) -> torch.Tensor:
        self.entries.append((value, value._version))
        return value

    def replay(self) -> torch.Tensor:
        if self.position >= len(self.entries) or self.entries[self.position] is None:
            raise RuntimeError("activation recomputation asked for a result its forward did not keep")
        value, version = self.entries[self.position]
        self.entries[self.position] = None  # a region recomputes once: drop the reference
        self.position += 1
        if value._version != version:
            raise RuntimeError("a result kept for recomputation was modified in place after the forward")
        return value


def kept(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """compute() — recorded in a selective region's forward, and given back instead of computed
    again when the region recomputes."""
    tape = getattr(_local, "tape", None)
    if tape is None or not tape.selective:
        return compute()
    return tape.replay() if tape.replaying else tape.record(compute())


def reused(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """compute() — recorded in a checkpointed region's forward (full or selective), and given back
    instead of computed again when the region recomputes. `compute` must save no tensor for
    backward (a cast does not)."""
    tape = getattr(_local, "tape", None)
    if tape is None or capturing():
        return compute()
    return tape.replay() if tape.replaying else tape.record(compute())


def checkpointing() -> bool:
    """Whether the forward now running is inside an activation-checkpointed region (its first
    run or its recomputation): what it saves for backward is then not kept from the first run."""
    return getattr(_local, "tape", None) is not None


def capturing() -> bool:
    """Whether a CUDA graph is being captured: its launches are free, so `reused` computes again
    rather than keeping a copy through the step (and `grouped_mm` saves the factors it would hold)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def recomputing() -> bool:
    """Whether the forward now running is a recomputation (in backward)."""
    return getattr(_local, "recomputing", False)


@contextlib.contextmanager
def _set(tape: _Tape | None, recomputation: bool):
    previous = getattr(_local, "tape", None), recomputing()
    _local.tape, _local.recomputing = tape, recomputation
    if tape is not None:
        tape.replaying, tape.position = recomputation, 0
    try:
        yield
    finally:
        _local.tape, _local.recomputing = previous


def checkpointed(function: Callable[..., Any], mode: str, *args: Any) -> Any:
    """function(*args) under activation checkpointing of `mode` ("full" or "selective")."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation checkpointing mode must be 'full' or 'selective', got {mode!r}")

    def contexts():
        tape = _Tape(selective=mode == "selective")
        return _set(tape, False), _set(tape, True)

    return checkpoint(function, *args, use_reentrant=False, context_fn=contexts)
