"""`moemesh serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) in front of the
scheduler, so that the official `openai` client works unchanged. HTTP only: requests are read and
checked by protocol.py, answered in responses.py's objects (in front.py's process), and run by the
scheduler's thread.

Two processes (link.py says why and what crosses between them): this one holds the engine and
the scheduler's thread; the HTTP server runs in a child process, a fresh interpreter on the
listening socket this one bound, so that its Python never holds the engine's GIL. Not
multiprocessing's `spawn`: that would import the caller's main script again in the child (a
script that serves without an `if __name__ == "__main__"` guard would load its model a second
time); and forking a process that holds a GPU is unsafe.

    GET  /health                   200 while serving (no key needed)
    GET  /v1/models                the one model
    GET  /v1/models/{id}           it, or a 404 for another id
    POST /v1/completions           prompt: text or token ids, one or a list (docs/openai_api.md)
    POST /v1/chat/completions      for tokenizers with a chat template (chat.py); else 400; tool
                                   calls and reasoning read by the family's parsers (parsers/)
    POST /v1/responses             OpenAI's Responses API, stateless, on the chat path
                                   (responses_api.py); its stream is its semantic events

Streams are server-sent events, one chunk per token (with the text that became final, maybe ""),
ending in `data: [DONE]`; the chunks that have come since a stream's last write go in one write.
Errors are OpenAI's error object with their status, never plain text: 400 for a bad body or
field (protocol.py names it), 401 without the API key (when one is set), 404 for another model
or path, 405 for another method, 413 for a body over the limit, 415 for a body that is not JSON,
500 when a request's generation fails (that request alone), 503 with Retry-After when the
waiting queue is full.

A client that leaves frees its rows at the next step: a stream's end cancels its sequences, and
while a non-streaming request runs, a watcher waits for the connection's http.disconnect message.
Each request is logged on the `moemesh.serve` logger (of the engine's process) in one line:
method, path, status, prompt and completion tokens, seconds. If either process ends, so does the
other.

This module holds the engine's side; front.py is the HTTP process's (it imports no torch). They
need fastapi and uvicorn (`pip install moemesh[serve]`); a missing one is a one-line error before
the weights are read. Nothing else in moemesh imports them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.connection
import os
import socket
import subprocess
import sys
import threading

from moemesh.data.tokenizer import Tokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.front import HttpSettings
from moemesh.inference.link import EngineLink
from moemesh.inference.scheduler import Scheduler

log = logging.getLogger("moemesh.serve")
STOP_WAIT_S = 10  # for the other process to end, once one has


class Service:
    """The scheduler on its own thread, and the HTTP process that feeds it."""

    def __init__(
        self,
        engine: DecodeEngine,
        tokenizer: Tokenizer,
        model_name: str = "moemesh",
        api_key: str | None = None,
        max_waiting: int = 64,
        max_request_bytes: int = 1 << 20,
        reply_window_ms: float = 25.0,  # serve's --reply-window-ms (inference/scheduler.py says why)
        prefill_first: bool = False,  # serve's --schedule prefill-first (inference/scheduler.py)
        overlap: bool = True,  # not serve's --no-overlap (inference/scheduler.py)
        tool_call_parser: str | None = None,  # serve's --tool-call-parser (None: chosen; parsers/registry.py)
        reasoning_parser: str | None = None,  # serve's --reasoning-parser
    ):
        self.engine = engine
        self.scheduler = Scheduler(
            engine, tokenizer, max_waiting, reply_window_ms / 1e3, prefill_first, overlap=overlap
        )
        model_type = getattr(getattr(getattr(engine, "model", None), "config", None), "model_type", None)
        self.settings = HttpSettings(
            tokenizer,
            model_name,
            api_key,
            max_request_bytes,
            engine.max_len,
            engine.vocab,
            max_waiting,
            model_type,
            tool_call_parser,
            reasoning_parser,
        )
        self.link: EngineLink | None = None
        self.http: subprocess.Popen | None = None  # the HTTP server's process while it runs
        self.ready = threading.Event()  # set once the HTTP process serves

    def serve(self, host: str = "127.0.0.1", port: int = 8000, sock=None, announce: bool | None = None) -> None:
        """Run until interrupted (or `shutdown`, or the HTTP process's end): the engine's warm-up,
        the scheduler's thread, the HTTP process, on `sock` when given (bound already). `announce`
        (default: without `sock`) prints the warm-up's time and the URL."""
        announce = sock is None if announce is None else announce
        seconds = self.engine.warm_up()
        if announce:
            print(
                f"moemesh serve: decode steps of batch 1 to {self.engine.max_batch} and packed steps of up "
                f"to {self.engine.max_num_batched_tokens} tokens ready in {seconds:.1f} s; the KV cache holds "
                f"{self.engine.capacity:,} tokens, a sequence up to {self.engine.max_len:,}",
                flush=True,
            )
        if sock is None:
            sock = socket.create_server((host, port))
        ours, theirs = socket.socketpair()
        # moemesh found where this process found it, after the child's own paths (never before them)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        start = (
            f"import sys; sys.path.append({package_root!r}); from moemesh.inference.front import main; "
            f"main({theirs.fileno()}, {sock.fileno()})"
        )
        self.http = subprocess.Popen([sys.executable, "-c", start], pass_fds=(theirs.fileno(), sock.fileno()))
        theirs.close()
        conn = multiprocessing.connection.Connection(ours.detach())
        conn.send(self.settings)
        self.link = link = EngineLink(conn, self.scheduler)
        listener = threading.Thread(target=link.listen, name="moemesh-link", daemon=True)
        worker = threading.Thread(
            target=self.scheduler.serve_forever, kwargs={"after_step": link.deliver}, name="moemesh-scheduler"
        )
        listener.start()
        worker.start()
        try:
            while not link.ready.wait(0.1):
                if (code := self.http.poll()) is not None:
                    raise RuntimeError(f"the HTTP server's process ended while starting (exit code {code})")
            self.ready.set()
            if announce:
                port = sock.getsockname()[1]  # --port 0: the one the system chose
                print(f"moemesh serve: {self.settings.model_name} on http://{host}:{port}", flush=True)
            self.http.wait()
        finally:
            self.shutdown()
            try:
                self.http.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.http.terminate()
                self.http.wait()
            self.scheduler.close()
            worker.join()
            conn.close()

    def shutdown(self) -> None:
        """Ask the HTTP process to stop (it finishes the responses under way, for a few seconds)."""
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.link.send(("shutdown",))


def serve(
    engine: DecodeEngine, tokenizer: Tokenizer, host: str = "127.0.0.1", port: int = 8000, sock=None, **settings
) -> None:
    """Serve until interrupted (on `sock` when given, bound to host:port), a line a request on
    standard error; then release the other ranks of a tensor-parallel group."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    try:
        Service(engine, tokenizer, **settings).serve(host, port, sock, announce=True)
    finally:
        engine.close()
