"""How many threads a run on the CPU computes on.

Why: torch starts one thread per physical core, and its ops meet at a barrier after every parallel
loop. When other work holds some of the cores, the threads on them arrive late at every barrier
and the others spin waiting: the default run on a 2-core machine with one core busy trained at 311
tokens/s on torch's two threads and at 3.7k on one (2026-12-01). So a CPU run counts the cores
that were idle while it started (from /proc/stat, over a tenth of a second) and computes on that
many, never more than torch's default, at least one; the ranks of a run launched on one machine
share them. `train.threads` (first) or `OMP_NUM_THREADS` set the number instead.

On an idle machine torch's count pays: the default run trained at 18k tokens/s on two threads
and 11.5k on one; with one core busy at 0.8k on two and 11.1k on one (2-core Xeon, 2026-12-01).

The count changes a loss's last bits (a sum split among threads adds in another order: the
default run's loss at step 30 was 3.0687 on two threads and 3.0691 on one). So a checkpoint
records it, and a resumed run computes on the count of the run it resumes unless told otherwise,
to reproduce that run's losses exactly (`Trainer._start`).

Limits: work that starts after the run does is not seen; where /proc/stat is missing (macOS,
Windows) torch's default stands; under a CPU quota (a container's cgroup) the cores are counted
as the machine's, not the quota's.
"""

import contextlib
import os
import time
from dataclasses import dataclass

import torch

SAMPLE_S = 0.1  # how long the cores are watched at the start: 10 of the kernel's 10-ms ticks a core


@dataclass(frozen=True)
class Threads:
    count: int
    why: str  # said in the run's first lines: where the number came from
    chosen_here: bool = True  # False: set by train.threads or OMP_NUM_THREADS, not by the machine's load

    def __str__(self) -> str:
        return f"{self.count} thread{'s' if self.count > 1 else ''}: {self.why}"


def idle_cores(sample_s: float = SAMPLE_S, stat_path: str = "/proc/stat") -> float | None:
    """How many of this process's cores were idle over `sample_s` seconds (fractions summed), or
    None where the kernel's per-CPU counters cannot be read."""
    try:
        cores = os.sched_getaffinity(0)
    except AttributeError:
        return None

    def counters() -> dict[int, tuple[int, int]]:  # cpu -> (idle ticks, all ticks)
        times = {}
        with open(stat_path) as stat:
            for line in stat:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                    ticks = [int(f) for f in fields[:8]]  # user nice system idle iowait irq softirq steal
                    times[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks))
        return times

    try:
        before = counters()
        time.sleep(sample_s)
        after = counters()
    except (OSError, ValueError, IndexError):
        return None
    idle = 0.0
    for cpu, (idle_after, total_after) in after.items():
        idle_before, total_before = before.get(cpu, (idle_after, total_after))
        elapsed = total_after - total_before
        idle += (idle_after - idle_before) / elapsed if elapsed > 0 else 1.0
    return idle if after else None


def choose_threads(requested: int = 0, local_ranks: int = 1, measure=idle_cores) -> Threads:
    """The thread count of a CPU run: `requested` (train.threads) when > 0, else OMP_NUM_THREADS's
    (torch read it at import), else the cores idle at the start (`measure()`) shared by the
    `local_ranks` processes of this machine, within torch's default."""
    default = torch.get_num_threads()
    if requested > 0:
        return Threads(requested, "train.threads", chosen_here=False)
    if os.environ.get("OMP_NUM_THREADS"):
        return Threads(default, "OMP_NUM_THREADS", chosen_here=False)
    idle = measure()
    if idle is None:
        return Threads(default, "torch's default; train.threads or OMP_NUM_THREADS set it")
    count = max(1, min(default, int(idle + 0.5) // max(local_ranks, 1)))
    shared = f", shared by {local_ranks} processes" if local_ranks > 1 else ""
    return Threads(
        count,
        f"{idle:.1f} of {len(os.sched_getaffinity(0))} cores idle at the start{shared}; "
        "train.threads or OMP_NUM_THREADS set it",
    )


@contextlib.contextmanager
def cpu_threads(device: torch.device, requested: int = 0):
    """Inside, torch computes on `choose_threads`'s count when `device` is the CPU (yields the
    Threads, or None on a GPU); the count before is restored after."""
    if device.type != "cpu":
        yield None
        return
    before = torch.get_num_threads()
    chosen = choose_threads(requested, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(chosen.count)
    try:
        yield chosen
    finally:
        torch.set_num_threads(before)
