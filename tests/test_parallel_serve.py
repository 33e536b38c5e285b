"""`moemesh serve` under torchrun with tensor parallelism (CPU, gloo, 2 processes): rank 0 serves
HTTP and broadcasts each step, rank 1 follows; its greedy completions, streamed or not, are the
text one process's `moemesh generate` writes."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")

from moemesh.cli import main  # noqa: E402
from multiprocess import free_port  # noqa: E402
from serving import write_checkpoint  # noqa: E402


def test_a_tp2_server_answers_what_one_process_generates(tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "checkpoint")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "moemesh",
            "serve",
            "--checkpoint",
            str(checkpoint),
            "--tp",
            "2",
            "--port",
            str(port),
            "--max-len",
            "128",
            "--max-batch",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read().decode()[-3000:]
            time.sleep(0.2)
        asks = [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in ("def main", "hello", "the quick")]
        texts = [httpx.post(url + "/v1/completions", json=ask, timeout=60).json()["choices"][0]["text"] for ask in asks]
        with httpx.stream("POST", url + "/v1/completions", json={**asks[0], "stream": True}, timeout=60) as reply:
            streamed = "".join(
                json.loads(line[6:])["choices"][0]["text"] for line in reply.iter_lines() if line.startswith("data: {")
            )
        assert streamed == texts[0]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    # What it holds, said at start: 2 rows of 128 on a CPU (--max-batch, --max-len)
    assert "the KV cache holds 256 tokens, a sequence up to 128" in server.stdout.read().decode()
    for ask, text in zip(asks, texts):
        assert (
            main(["generate", "--checkpoint", str(checkpoint), "--prompt", ask["prompt"], "--max-new-tokens", "16"])
            == 0
        )
        assert capsys.readouterr().out == ask["prompt"] + text + "\n"
