"""What the other ranks of a run see when one rank stops (SIGSTOP: alive, holding its connections,
never answering), and how long until the job ends:

    PYTHONPATH=. python3 bench/parallel/stopped_rank.py [--nproc 2] [--timeout 60] [--set parallel.dp_shard=2 ...]

Starts `torchrun --nproc-per-node N -m moemesh train` on configs/tiny.toml (NCCL on GPUs, gloo on
CPUs) with parallel.timeout_s=--timeout, stops rank 1 once the run has taken 5 steps, and prints
each line the job writes to standard error from then on, with the seconds since the stop, and
when and how torchrun ended. --kill kills the stopped rank as soon as a peer has said something,
instead of leaving it to torchrun (which SIGTERMs it, and SIGKILLs it 30 s later).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import print_table


def _rank_of(pid: int) -> int | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next((int(v[5:]) for v in environ if v.startswith(b"RANK=")), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="parallel.timeout_s")
    parser.add_argument("--kill", action="store_true", help="SIGKILL the stopped rank after the first line")
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        default=["parallel.dp_shard=2"],
        help="config overrides of the run (default: parallel.dp_shard=2)",
    )
    args = parser.parse_args()

    run_dir = tempfile.mkdtemp(prefix="moemesh-stopped-")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.nproc),
        "-m",
        "moemesh",
        "train",
        "--set",
        *args.overrides,
        f"parallel.timeout_s={args.timeout}",
        "train.steps=100000",
        "train.save_every=-1",
        "train.eval_every=0",
        "train.log_every=1",
        f"train.run_dir={run_dir}",
    ]
    agent = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rows = []
    try:
        for line in agent.stdout:
            if (step := re.match(r"step +(\d+)/", line)) and int(step.group(1)) >= 5:
                break
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
        stopped = next(int(pid) for pid in children if _rank_of(int(pid)) == 1)
        os.kill(stopped, signal.SIGSTOP)
        start = time.monotonic()
        for line in agent.stderr:
            if not line.startswith((" ", "Traceback")):
                rows.append({"s": f"{time.monotonic() - start:.1f}", "line": line.rstrip()[:240]})
            if args.kill and len(rows) == 1:
                os.kill(stopped, signal.SIGKILL)
        agent.wait()
        rows.append({"s": f"{time.monotonic() - start:.1f}", "line": f"(torchrun exited with {agent.returncode})"})
    finally:
        agent.kill()
    print_table(rows, f"rank 1 of {args.nproc} stopped, parallel.timeout_s={args.timeout}: standard error from then on")


if __name__ == "__main__":
    main()
