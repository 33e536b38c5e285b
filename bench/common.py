"""Timing and memory helpers shared by the benchmark scripts (timing also on CPU, for smoke runs)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖, computed in float64."""
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def median_ms(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events after warm-up (with the
    host clock where there is no GPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory fn() allocates above what was already allocated before it ran."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n## {title}")
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths)) + " |")
