"""Continuous batching: requests wait in a bounded queue, take a free cache row as soon as one
is free (their prompt prefilled, their first token sampled), and join the running batch at the
next decode step; a finished or cancelled request gives its row back at once.

`step` is one round (drop cancelled requests, admit waiting ones, one decode step of every
running one); `run_until_idle` drives it for a batch job (`moemesh generate`), `serve_forever`
for the server, on its own thread, sleeping while there is nothing to do. `submit` may be called
from any thread; a full queue raises QueueFull (the server's 503). Rows are handed out lowest
first, so a decode step's batch stays as small as the number of running requests allows.

A request's failure is that request's alone: what is done for one row after the engine's step
(processing.py: penalties, biases, grammars, log-probabilities; its text and stops) runs under
its own guard, and a row that raises finishes with "error" while the others go on. Only a
failing engine step (the model or the device) fails every request in it.
"""

from __future__ import annotations

import heapq
import threading
import traceback
from collections import Counter, deque
from collections.abc import Callable

import torch

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import MoemeshError
from moemesh.inference.engine import DecodeEngine, RowStep
from moemesh.inference.grammar import Grammars
from moemesh.inference.processing import FLOOR, RowSampler
from moemesh.inference.request import Logprob, SamplingParams, Sequence, check_request


class QueueFull(MoemeshError):
    """Every row is busy and the waiting queue is at its limit."""


class Scheduler:
    def __init__(self, engine: DecodeEngine, tokenizer: Tokenizer, max_waiting: int = 64):
        self.engine, self.tokenizer, self.max_waiting = engine, tokenizer, max_waiting
        self.free_rows = list(range(engine.max_batch))  # a heap: the lowest row first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.decode_batches: Counter[int] = Counter()  # requests in a decode step -> how many steps had that many
        self.closed = False
        self._wake = threading.Condition()
        self.grammars = Grammars(tokenizer, engine.vocab)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, on_update: Callable[[Sequence, str], None] | None = None
    ) -> Sequence:
        """Queue a request (RequestError if it cannot run, QueueFull if the queue is full)."""
        check_request(prompt_ids, params, self.engine.max_len, self.engine.vocab)
        sequence = Sequence(prompt_ids, params, self.tokenizer, on_update)
        if params.processed:
            stops = frozenset(sequence.stop_ids)
            matcher = None if params.grammar is None else self.grammars.matcher(params.grammar, stops)
            sequence.sampler = RowSampler(params, prompt_ids, self.engine.vocab, self.engine.device, matcher, stops)
        with self._wake:
            if self.closed:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the limit)")
            self.waiting.append(sequence)
            self._wake.notify()
        return sequence

    def step(self) -> bool:
        """One round; False when there was nothing to do."""
        with self._wake:
            for sequence in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(sequence)
                sequence.finish("cancelled")
        self._retire()
        admitted = self._admit()
        self._retire()
        if not self.running:
            return admitted
        rows = [RowStep(s.row, s.token_ids[-1], s.position, len(s.token_ids), s.params.sampling) for s in self.running]
        self.decode_batches[len(rows)] += 1
        tokens = self.engine.decode(rows)
        for sequence, token in zip(list(self.running), tokens):
            self._take(sequence, token, self.engine.last_logits[sequence.row])
        self._retire()
        return True

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def serve_forever(self, keep_alive_s: float = 30.0) -> None:
        """Run rounds until `close`; a failing round fails the requests in it, and serving goes on.
        Idle, it tells the engine every keep_alive_s that it is alive (tensor-parallel followers)."""
        while True:
            with self._wake:
                while not (self.closed or self.waiting or self.running):
                    if not self._wake.wait(timeout=keep_alive_s):
                        self.engine.keep_alive()
                if self.closed:
                    break
            try:
                self.step()
            except Exception:  # a bug or a device error: report it to the requests, keep serving
                error = traceback.format_exc()
                print(error, flush=True)
                for sequence in self.running:
                    sequence.finish("error", error.strip().splitlines()[-1])
                self._retire()
        for sequence in [*self.waiting, *self.running]:
            sequence.finish("cancelled")

    def close(self) -> None:
        with self._wake:
            self.closed = True
            self._wake.notify()

    def _admit(self) -> bool:
        admitted = False
        while self.free_rows:
            with self._wake:
                if not self.waiting:
                    break
                sequence = self.waiting.popleft()
            sequence.row = heapq.heappop(self.free_rows)
            self.running.append(sequence)
            admitted = True
            params = sequence.params
            token = self.engine.prefill(sequence.row, sequence.prompt_ids, params.sampling, params.prompt_logprobs)
            with self._guard(sequence):
                if params.prompt_logprobs is not None:
                    sequence.prompt_logprobs = [None, *_logprobs(*self.engine.last_prompt_logprobs)]
                if params.max_tokens == 0:  # the prompt's log-probabilities alone
                    sequence.finish("length")
                    continue
                self._take(sequence, token, self.engine.last_logits[0])
        return admitted

    def _take(self, sequence: Sequence, token: int, logits: torch.Tensor) -> None:
        """The row's token after the step: processed when it asks for it, then added."""
        with self._guard(sequence):
            logprob = None
            if sequence.sampler is not None:
                token, logprob = sequence.sampler.choose(logits, token, len(sequence.token_ids))
            sequence.add(token, self.engine.max_len, logprob)

    class _guard:
        """Fail one request, not the step, when its own work raises."""

        def __init__(self, sequence: Sequence):
            self.sequence = sequence

        def __enter__(self):
            return self

        def __exit__(self, kind, error, tb):
            if error is None or not isinstance(error, Exception):
                return False
            print("".join(traceback.format_exception(kind, error, tb)), flush=True)
            try:
                self.sequence.finish("error", f"{kind.__name__}: {error}")
            except Exception:  # its listener is gone too
                self.sequence.finish_reason = "error"
            return True

    def _retire(self) -> None:
        """Give the rows of finished and cancelled requests back."""
        for sequence in [s for s in self.running if s.cancelled or s.finish_reason is not None]:
            sequence.finish("cancelled")
            self.running.remove(sequence)
            heapq.heappush(self.free_rows, sequence.row)


def _logprobs(chosen: torch.Tensor, ids: torch.Tensor, top: torch.Tensor) -> list[Logprob]:
    """engine.last_prompt_logprobs as one Logprob a token (-inf as processing.FLOOR)."""
    return [
        Logprob(max(c, FLOOR), tuple((i, max(v, FLOOR)) for i, v in zip(row_ids, row_top)))
        for c, row_ids, row_top in zip(chosen.tolist(), ids.tolist(), top.tolist())
    ]
