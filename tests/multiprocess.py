"""A pool of worker processes joined in one gloo process group, started once per test module and
reused by many checks: `pool.run(fn, *args)` runs the module-level function `fn(rank, *args)` on
every rank and returns the per-rank results, or raises with the failing rank's traceback.

A check that hangs (a collective waiting for a peer) fails after `timeout_s` instead of blocking
the suite.

The workers are forked from multiprocessing's fork server, a process that imported torch and
moemesh once for the session (PRELOAD), rather than each a fresh interpreter importing them
again: a pool of 4 starts in 0.1 s instead of 5 (2 cores) and its first check skips the imports.
A worker takes the test process's environment as it is when the pool starts; what is read at
import (TRITON_INTERPRET, set by conftest.py before any pool) is the fork server's, as of the
first pool."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "moemesh.train.trainer", "moemesh.inference.engine"]


def _worker(rank: int, world_size: int, port: int, tasks, results, timeout_s: float, environ: dict) -> None:
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)  # several ranks share the machine's few cores
    if os.environ.get("TRITON_INTERPRET") == "1":  # the test process's (conftest.py)
        from triton_interpreter import patch_lang_once_per_launch

        patch_lang_once_per_launch()
    # Collectives give up before the parent does, so a rank stuck on a failed peer reports too.
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s / 2))
    while (task := tasks.get()) is not None:
        fn, args = task
        try:
            results.put((rank, True, fn(rank, *args)))
        except BaseException:  # report every failure to the parent, then keep serving
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()
    # Out without Python's finalization: its collection over every object torch and the checks
    # imported took 3-5 s a process (4 ranks on 2 cores), which the pool's close waited for. Every
    # result has reached the parent, which asked for the exit; what this process put is flushed.
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class WorkerPool:
    def __init__(self, world_size: int, timeout_s: float = 120.0):
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)  # (read when the fork server starts, at the first pool)
        self.world_size, self.timeout_s = world_size, timeout_s
        self.tasks = [context.Queue() for _ in range(world_size)]
        self.results = context.Queue()
        port = free_port()
        self.processes = [
            context.Process(
                target=_worker,
                args=(r, world_size, port, self.tasks[r], self.results, timeout_s, dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self.processes:
            p.start()

    def run(self, fn, *args) -> list:
        for q in self.tasks:
            q.put((fn, args))
        outcomes = {}
        while len(outcomes) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=self.timeout_s)
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                outcomes.update({r: (False, f"did not finish within {self.timeout_s:.0f}s") for r in missing})
                break
            outcomes[rank] = (ok, value)
        failures = [f"rank {r}: {v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} rank(s)\n" + "\n".join(failures))
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
