"""Deferred weight gradients (zero-bubble pipelines, DeepSeek's WeightGradStore).

A backward run with `deferring(True)` computes the gradients that other stages wait for (those of
the inputs) at once; the matmuls of `linear.py` and `grouped_mm.py` queue their weight-gradient
GEMMs of that backward instead (`put`), as one entry. A later W operation of the schedule runs
the oldest entry (`pop`), filling a bubble where the rank would otherwise wait. Entries are made
even when no op queued anything, so the schedule's W count always matches.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable

import torch

_current: list[Callable[[], None]] | None = None  # the entry being filled, while deferring


def put(job: Callable[[], None]) -> bool:
    """Queue `job` (a weight-gradient computation) if a deferred backward is running; returns
    False when the caller must run it now."""
    if _current is None:
        return False
    _current.append(job)
    return True


class WeightGradStore:
    def __init__(self):
        self._queue: deque[list[Callable[[], None]]] = deque()

    @contextlib.contextmanager
    def deferring(self, enabled: bool):
        global _current
        if not enabled:
            yield
            return
        _current, entry = [], None
        try:
            yield
            entry = _current
        finally:
            _current = None
        self._queue.append(entry)

    def pop(self) -> None:
        """Run the oldest deferred backward's weight gradients."""
        for job in self._queue.popleft():
            job()

    def flush(self) -> None:
        """Run whatever is still queued (a schedule ends with none)."""
        while self._queue:
            self.pop()

    def __len__(self) -> int:
        return len(self._queue)


def send_gradients(grads: list[torch.Tensor | None], tensors: tuple[torch.Tensor | None, ...]) -> None:
    """Backward from each tensor given a gradient (a deferred weight-gradient job)."""
    pairs = [(t, g) for t, g in zip(tensors, grads) if g is not None]
    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
