"""Scratch timestamps of a served request's stages (an experiment, reverted after it was measured):
`time.perf_counter` is CLOCK_MONOTONIC on Linux, one clock for the clients', the HTTP and the
engine's processes. Each process appends `kind id seconds` lines to /tmp/probe/<pid>.txt;
bench/served_stages.py joins them."""

import os
import time

now = time.perf_counter
_file = None


def rec(*fields):
    global _file
    if _file is None:
        os.makedirs("/tmp/probe", exist_ok=True)
        _file = open(f"/tmp/probe/{os.getpid()}.txt", "a", buffering=1)
    _file.write(" ".join(str(x) for x in fields) + "\n")
