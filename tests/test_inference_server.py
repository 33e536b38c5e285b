"""`moemesh serve` over real HTTP on 127.0.0.1, with the official `openai` client: completions
(one prompt and a list), streaming, chat, every malformed request of the issue (4xx with
OpenAI's error object, the server serving on), a client that disconnects mid-stream freeing its
row, concurrent clients sharing decode steps, 401 / 413 / 503, and a bounded soak test.

One server for the module (its engine in this process, so that a test can look at its scheduler;
its HTTP side in a child process, as `moemesh serve` runs), with an API key and a 64 KiB body
limit, over a tiny random-weight model (tests/serving.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests use the openai client")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")

from moemesh.cli import main  # noqa: E402
from moemesh.inference.engine import DecodeEngine  # noqa: E402
from moemesh.inference.generate import load_for_generation  # noqa: E402
from moemesh.inference.server import Service  # noqa: E402
from serving import ServerThread, openai_client, write_checkpoint  # noqa: E402

KEY = "test-key"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("served"))


@pytest.fixture(scope="module")
def server(checkpoint):
    model, tokenizer = load_for_generation(checkpoint)
    service = Service(
        DecodeEngine(model, max_batch=4, max_len=1024),
        tokenizer,
        model_name="tiny",
        api_key=KEY,
        max_waiting=16,
        max_request_bytes=LIMIT,
    )
    running = ServerThread(service)
    yield running
    running.stop()


@pytest.fixture
def client(server):
    return openai_client(server.url, KEY)


def _idle(server, timeout=10.0) -> bool:
    """Wait until the scheduler has nothing running or waiting and every row is free."""
    scheduler = server.service.scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not scheduler.running and not scheduler.waiting and len(scheduler.free_rows) == scheduler.engine.max_batch:
            return True
        time.sleep(0.02)
    return False


def test_a_greedy_completion_is_what_moemesh_generate_writes(client, checkpoint, capsys):
    reply = client.completions.create(model="tiny", prompt="def main", max_tokens=20, temperature=0)
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "def main", "--max-new-tokens", "20"]) == 0
    assert capsys.readouterr().out == "def main" + reply.choices[0].text + "\n"
    assert reply.object == "text_completion" and reply.model == "tiny"
    assert reply.choices[0].finish_reason == "length"  # the test model never predicts its special tokens
    assert reply.usage.completion_tokens == 20
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_a_list_of_prompts_gets_one_choice_each(client):
    alone = [
        client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
        for p in ("hello", "the quick")
    ]
    reply = client.completions.create(model="tiny", prompt=["hello", "the quick"], max_tokens=8, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == alone


def test_seeded_sampling_repeats(client):
    ask = dict(model="tiny", prompt="hello", max_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


def test_streaming_adds_up_to_the_completion_and_ends_with_done(client, server):
    whole = client.completions.create(model="tiny", prompt="hello", max_tokens=15, temperature=0)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=15,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    raw = httpx.post(
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "hello", "max_tokens": 3, "stream": True},
        timeout=30,
    )
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.text.endswith("data: [DONE]\n\n")


def test_chat_completions_render_the_template(client, checkpoint):
    from moemesh.inference.generate import generate
    from moemesh.inference.request import SamplingParams

    messages = [{"role": "user", "content": "hello"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    model, tokenizer = load_for_generation(checkpoint)
    prompt = tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    end = tokenizer.encode("<|im_end|>")
    expected = generate(
        DecodeEngine(model, max_batch=1), tokenizer, [prompt], SamplingParams(max_tokens=10, stop_token_ids=tuple(end))
    )[0]
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == len(prompt)
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed


BAD = [
    ('{"model": "tiny", "prompt": ', 400, None, "not valid JSON"),
    ({"model": "tiny"}, 400, "prompt", "prompt must be a string"),
    ({"model": "tiny", "prompt": 5}, 400, "prompt", "prompt must be a string"),
    ({"model": "tiny", "prompt": ["a", 3]}, 400, "prompt", "prompt must be a string"),
    ({"model": "tiny", "prompt": [1, 2, 999]}, 400, "prompt", "token id 999 is not in [0, 320)"),
    ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    ({"model": "tiny", "prompt": "a", "max_tokens": 5000}, 400, "max_tokens", "exceed the context (1024 tokens)"),
    ({"model": "tiny", "prompt": "a", "max_tokens": "9"}, 400, "max_tokens", "must be an integer, got a string"),
    ({"model": "tiny", "prompt": "a", "temperature": -0.5}, 400, "temperature", "temperature must be"),
    ({"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "a", "top_p": 1.5}, 400, "top_p", "top_p must be in (0, 1]"),
    ({"model": "tiny", "prompt": "a", "n": 0}, 400, "n", "n must be an integer >= 1"),
    ({"model": "tiny", "prompt": "hello world " * 500}, 400, "prompt", "the context holds 1024"),
    ({"model": "other", "prompt": "a"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("body, status, param, message", BAD)
def test_malformed_requests_get_openai_errors(server, body, status, param, message):
    content = body if isinstance(body, str) else json.dumps(body)
    reply = httpx.post(
        server.url + "/v1/completions",
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert reply.status_code == status
    error = reply.json()["error"]
    assert (
        set(error) == {"message", "type", "param", "code"} and error["param"] == param and message in error["message"]
    )


def test_the_openai_client_sees_the_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.completions.create(model="tiny", prompt="a", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
        client.chat.completions.create(model="tiny", messages=[])
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices  # still serving


def test_chat_without_a_template_is_a_400(tmp_path):
    checkpoint = write_checkpoint(tmp_path, chat_template=False)
    model, tokenizer = load_for_generation(checkpoint)
    running = ServerThread(Service(DecodeEngine(model, max_batch=1, max_len=64), tokenizer, model_name="t"))
    try:
        reply = httpx.post(running.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}]})
        assert reply.status_code == 400 and "has no chat template" in reply.json()["error"]["message"]
    finally:
        running.stop()


def test_the_http_side_is_a_process_of_its_own_without_torch_and_its_end_ends_serve(checkpoint):
    """The HTTP server answers from a process apart from the engine's, which has not loaded torch
    (front.py: it starts fast and holds none of it), also once a request's tokens and
    log-probabilities have crossed; when that process dies (killed, as by the out-of-memory
    killer), `serve` returns and the scheduler is closed rather than serving nobody for ever."""
    model, tokenizer = load_for_generation(checkpoint)
    service = Service(DecodeEngine(model, max_batch=1, max_len=64), tokenizer, model_name="t")
    running = ServerThread(service)
    try:
        assert service.http.pid != os.getpid() and service.http.poll() is None
        # seeded: an unseeded draw at temperature 1 may stop before its 3 tokens
        body = {"prompt": "a", "max_tokens": 3, "logprobs": 2, "echo": True, "seed": 0}
        reply = httpx.post(running.url + "/v1/completions", json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
        maps = Path(f"/proc/{service.http.pid}/maps")  # Linux's list of a process's mapped files
        if maps.exists():
            assert "libtorch" in Path(f"/proc/{os.getpid()}/maps").read_text()  # the check can fail
            assert "libtorch" not in maps.read_text()
        os.kill(service.http.pid, signal.SIGKILL)
        running.thread.join(timeout=30)
        assert not running.thread.is_alive() and service.scheduler.closed
    finally:
        running.stop()


def test_a_script_without_a_main_guard_serves(checkpoint, tmp_path):
    """The HTTP process is a fresh interpreter: a user's script that serves at its top level (no
    `if __name__ == "__main__"`) is not imported again in it, as multiprocessing's spawn would."""
    script = tmp_path / "serve_at_top_level.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "import httpx\n"
        "from moemesh.inference.engine import DecodeEngine\n"
        "from moemesh.inference.generate import load_for_generation\n"
        "from moemesh.inference.server import Service\n"
        "from serving import ServerThread\n"
        "print('loading', flush=True)\n"
        f"model, tokenizer = load_for_generation({str(checkpoint)!r})\n"
        "running = ServerThread(Service(DecodeEngine(model, max_batch=1, max_len=64), tokenizer))\n"
        "reply = httpx.post(running.url + '/v1/completions', json={'prompt': 'a', 'max_tokens': 2}, timeout=60)\n"
        "running.stop()\n"
        "print('answered', reply.status_code, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["loading", "answered", "200"]


def test_key_size_limit_and_full_queue(server, client, monkeypatch):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        reply = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    reply = httpx.post(
        server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, json={"prompt": "a" * (LIMIT + 1)}
    )
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    monkeypatch.setattr(server.service.scheduler, "max_waiting", 0)  # as if the queue were full
    with pytest.raises(openai.InternalServerError) as error:
        client.completions.create(model="tiny", prompt="a")
    assert error.value.status_code == 503 and "busy" in error.value.message


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, client, monkeypatch):
    submitted = []
    submit = server.service.scheduler.submit
    monkeypatch.setattr(server.service.scheduler, "submit", lambda *a: submitted.append(submit(*a)) or submitted[-1])
    stream = client.completions.create(model="tiny", prompt="hello", max_tokens=1000, temperature=0, stream=True)
    for _, _chunk in zip(range(2), stream):
        pass
    stream.close()
    assert _idle(server)
    assert submitted[0].finish_reason == "cancelled" and len(submitted[0].token_ids) < 1000


def test_concurrent_clients_share_decode_steps(server, client):
    server.service.scheduler.decode_batches.clear()
    texts, start = {}, threading.Barrier(4)

    def ask(i):
        start.wait()
        texts[i] = "".join(
            c.choices[0].text
            for c in client.completions.create(
                model="tiny", prompt=f"hello {i}", max_tokens=60, temperature=0, stream=True
            )
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(texts) == 4
    assert max(server.service.scheduler.decode_batches) >= 2  # some steps decoded several requests at once
    for i in range(4):  # and each is still what it is alone
        assert (
            texts[i]
            == client.completions.create(model="tiny", prompt=f"hello {i}", max_tokens=60, temperature=0)
            .choices[0]
            .text
        )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_soak(server):
    """6 clients × 15 requests each, seeded: valid completions (streamed or not), malformed bodies
    and streams dropped after a chunk, in two equal rounds. Every accepted, kept request gets its
    whole answer; the server ends idle, answers /health, and the second round grows the process
    by under 30 MB (Python's and torch's caches settle in the first)."""
    lost = []

    def client_loop(seed):
        rng = random.Random(seed)
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            for _ in range(15):
                kind = rng.choice(["plain", "stream", "drop", "bad"])
                body = {
                    "prompt": rng.choice(["hello", "def main", "the quick"]),
                    "max_tokens": rng.randint(1, 40),
                    "temperature": rng.choice([0, 0.8]),
                    "seed": rng.randint(0, 9),
                }
                if kind == "bad":
                    body[rng.choice(["max_tokens", "temperature", "top_p"])] = -3
                    assert http.post("/v1/completions", json=body).status_code == 400
                elif kind == "plain":
                    reply = http.post("/v1/completions", json=body).json()
                    if reply["choices"][0]["finish_reason"] not in ("stop", "length"):
                        lost.append(reply)
                else:
                    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                        lines = []
                        for line in reply.iter_lines():
                            lines.append(line)
                            if kind == "drop" and len(lines) >= 2:
                                break
                        if kind == "stream" and "data: [DONE]" not in lines[-2:]:
                            lost.append(lines[-4:])

    def round_(offset):
        threads = [threading.Thread(target=client_loop, args=(offset + i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert _idle(server)

    started = time.monotonic()
    round_(0)
    before = _rss_bytes()
    round_(100)
    assert _rss_bytes() - before < 30 << 20
    assert not lost
    assert httpx.get(server.url + "/health").status_code == 200
    assert time.monotonic() - started < 60
