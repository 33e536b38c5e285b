"""The pipe between `moemesh serve`'s two processes: the engine's (the scheduler's thread beside the
GPU) and the HTTP server's (uvicorn, FastAPI, the OpenAI protocol, the tokenizer's encoding).

Why two: in one process the event loop's Python and the scheduler's share one GIL. Under 64
streaming clients the loop took ~4 ms of CPU a round, and the scheduler's host work between two
GPU rounds waited for it: served rounds took 26 ms where the engine alone took 21 on an H200
(docs/benchmarks.md). vLLM's API server runs apart from its engine for the same reason.

What crosses, pickled over one socket pair (`multiprocessing.connection.Connection`); the
settings (front.HttpSettings) go first:

    HTTP -> engine   ("submit", key, [(prompt ids, SamplingParams), ...])   a request's sequences
                     ("cancel", key)        the client left or the request ended: free its rows
                     ("log", level, line)   a line for the `moemesh.serve` logger (the engine's)
                     ("ready",)             uvicorn serves
    engine -> HTTP   ("accepted", key) | ("refused", key, "busy" | "bad", message, param)
                     ("updates", [(key, index, tokens, logprobs, offsets, text, finish_reason,
                                   error, prompt_logprobs), ...])   one message a round, for all
                     ("shutdown",)

The scheduler's Sequence stays in the engine's process (sampling, detokenising, stop strings);
the HTTP side keeps a SequenceView of each, extended by the updates, which responses.py reads as
it would the Sequence. A round's updates go in one message, sent after the round (one pickle and
one wake-up of the HTTP side a round, not one a token a client).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from moemesh.errors import RequestError
from moemesh.inference.request import Logprob, QueueFull, SamplingParams, Sequence

if TYPE_CHECKING:  # the HTTP process imports this module, and no torch
    from moemesh.inference.scheduler import Scheduler

log = logging.getLogger("moemesh.serve")


class EngineLink:
    """The engine's side: requests in (a thread of their own), each round's updates out."""

    def __init__(self, conn, scheduler: Scheduler):
        self.conn, self.scheduler = conn, scheduler
        self.requests: dict[int, list[Sequence]] = {}
        self.outbox: list[tuple] = []  # this round's updates (the scheduler's thread)
        self.ready = threading.Event()  # set when the HTTP process serves
        self._send_lock = threading.Lock()  # the scheduler's thread and the listener both send

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def listen(self) -> None:
        """Until the pipe closes (the HTTP process ended)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "submit":
                self._submit(*message[1:])
            elif kind == "cancel":
                for sequence in self.requests.pop(message[1], ()):
                    sequence.cancelled = True
            elif kind == "log":
                log.log(message[1], message[2])
            elif kind == "ready":
                self.ready.set()

    def _submit(self, key: int, asks: list[tuple[list[int], SamplingParams]]) -> None:
        sequences: list[Sequence] = []
        try:
            for index, (prompt_ids, params) in enumerate(asks):
                sequences.append(self.scheduler.submit(prompt_ids, params, self._relay(key, index)))
        except (QueueFull, RequestError) as e:
            for sequence in sequences:
                sequence.cancelled = True
            kind = "busy" if isinstance(e, QueueFull) else "bad"
            return self.send(("refused", key, kind, str(e), getattr(e, "param", None)))
        self.requests[key] = sequences
        self.send(("accepted", key))

    def _relay(self, key: int, index: int) -> Callable[[Sequence, str], None]:
        sent = [0, 0]  # tokens, and the prompt's log-probabilities, sent so far

        def on_update(sequence: Sequence, text: str) -> None:  # on the scheduler's thread
            start, end = sent[0], len(sequence.token_ids)
            prompt = sequence.prompt_logprobs[sent[1] :]
            sent[0], sent[1] = end, len(sequence.prompt_logprobs)
            self.outbox.append(
                (
                    key,
                    index,
                    sequence.token_ids[start:end],
                    sequence.logprobs[start:end],
                    sequence.offsets[start:end],
                    text,
                    sequence.finish_reason,
                    sequence.error,
                    prompt,
                )
            )

        return on_update

    def deliver(self) -> None:
        """On the scheduler's thread after a round: its updates, in one message."""
        if self.outbox:
            updates, self.outbox = self.outbox, []
            try:
                self.send(("updates", updates))
            except OSError:  # the HTTP process has gone: nobody is waiting
                pass


class SequenceView:
    """The HTTP side's copy of a scheduler Sequence: the attributes responses.py reads."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams):
        self.prompt_ids, self.params = prompt_ids, params
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.offsets: list[int] = []
        self.prompt_logprobs: list[Logprob | None] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None


class Submitted:
    """A request the engine accepted: its sequences' views, and their updates as (index, new
    text, finish reason, (first, end) of the new tokens), the Sequence relay's shape."""

    def __init__(self, key: int, views: list[SequenceView]):
        self.key, self.views = key, views
        self.updates: asyncio.Queue = asyncio.Queue()


class HttpLink:
    """The HTTP process's side: requests out from the event loop, the engine's messages in (a
    thread that hands them to the loop)."""

    def __init__(self, conn):
        self.conn = conn
        self.loop: asyncio.AbstractEventLoop | None = None
        self.requests: dict[int, Submitted] = {}
        self.pending: dict[int, asyncio.Future] = {}
        self.on_shutdown: Callable[[], None] = lambda: None
        self._keys = itertools.count()

    def start(self) -> None:
        """On the event loop, once it runs: start reading, tell the engine's process."""
        self.loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, name="moemesh-link", daemon=True).start()
        self.conn.send(("ready",))

    async def submit(self, asks: list[tuple[list[int], SamplingParams]]) -> Submitted:
        """Queue the sequences on the engine (QueueFull or RequestError as the scheduler raised)."""
        key = next(self._keys)
        request = self.requests[key] = Submitted(key, [SequenceView(ids, params) for ids, params in asks])
        accepted = self.pending[key] = self.loop.create_future()
        self.conn.send(("submit", key, asks))
        refusal = await accepted
        if refusal is not None:
            del self.requests[key]
            kind, message, param = refusal
            raise QueueFull(message) if kind == "busy" else RequestError(message, param)
        return request

    def cancel(self, request: Submitted) -> None:
        """Free the request's rows (a no-op for a request that has ended)."""
        if self.requests.pop(request.key, None) is not None:
            self.conn.send(("cancel", request.key))

    def log(self, level: int, line: str) -> None:
        self.conn.send(("log", level, line))

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("gone",)
            self.loop.call_soon_threadsafe(self._dispatch, message)
            if message[0] == "gone":
                return

    def _dispatch(self, message: tuple) -> None:  # on the event loop
        kind = message[0]
        if kind == "updates":
            for key, index, tokens, logprobs, offsets, text, reason, error, prompt in message[1]:
                request = self.requests.get(key)
                if request is None:  # cancelled meanwhile
                    continue
                view = request.views[index]
                start = len(view.token_ids)
                view.token_ids += tokens
                view.logprobs += logprobs
                view.offsets += offsets
                view.text += text
                view.prompt_logprobs += prompt
                view.finish_reason, view.error = reason, error
                request.updates.put_nowait((index, text, reason, (start, len(view.token_ids))))
        elif kind in ("accepted", "refused"):
            future = self.pending.pop(message[1])
            if not future.done():
                future.set_result(None if kind == "accepted" else message[2:])
        elif kind in ("shutdown", "gone"):
            if kind == "gone":  # the engine's process ended: every request still running fails
                for request in self.requests.values():
                    for index, view in enumerate(request.views):
                        if view.finish_reason is None:
                            view.finish_reason, view.error = "error", "the engine's process stopped"
                            request.updates.put_nowait((index, "", "error", (len(view.token_ids),) * 2))
                for future in self.pending.values():
                    if not future.done():
                        future.set_result(("busy", "the server is shutting down", None))
            self.on_shutdown()
