"""One generation request as it runs: its settings, the tokens it has sampled, their text, and
when it stops — at the end-of-document token or another stop token (not part of the text), at `max_tokens`, at the end
of the context, or at a stop string (the text ends before it) — with what it streams on the way.

Text is released only once it is final: a token can end inside a UTF-8 character (the byte
tokenizer) or change how the tokens before it read (Hugging Face decoders), so the newest tokens
are decoded again with the few before them until they read as whole characters (vLLM's
incremental detokenisation; each token costs two decodes of a short window). While a request
has stop strings, the last len(longest stop) − 1 characters are held back from the stream, since
they may be the start of one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import RequestError
from moemesh.inference.engine import Sampling


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end the request like the end-of-document token (a chat turn's end)

    def check(self) -> None:
        """A RequestError naming the first field out of range."""

        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value):
            return (is_int(value) or isinstance(value, float)) and math.isfinite(value)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if not is_number(self.temperature) or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}", "temperature")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(f"stop must be non-empty strings, got {self.stop!r}", "stop")

    @functools.cached_property  # read for every running row at every step
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), self.seed)


def check_request(prompt_ids: list[int], params: SamplingParams, context: int) -> None:
    """A RequestError unless the request can run in a cache row of `context` entries."""
    params.check()
    if not prompt_ids:
        raise RequestError("the prompt is empty", "prompt")
    if len(prompt_ids) >= context:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens; the context holds {context} "
            "(the prompt and at least one new token)",
            "prompt",
        )


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] is the context for decoding what follows

    def add(self, token: int) -> str:
        """Append a token; return the text that became final (maybe "")."""
        self.ids.append(token)
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is left, as it reads now (at the end of the request)."""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read])
        now = self.tokenizer.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]


class Sequence:
    """A request in the scheduler. `on_update(sequence, new_text)` runs on the scheduler's
    thread for every token sampled (new_text: what became final, maybe "") and once more when
    the request finishes."""

    def __init__(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        on_update: Callable[[Sequence, str], None] | None = None,
    ):
        self.prompt_ids, self.params = prompt_ids, params
        self.stop_ids = {tokenizer.eos_id, *params.stop_token_ids} - {None}
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
        self.error: str | None = None
        self.row: int | None = None  # the cache row while it runs
        self.cancelled = False  # set from any thread; the scheduler drops the request at its next step
        self.on_update = on_update
        self._text = IncrementalText(tokenizer)
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._sent = 0

    @property
    def position(self) -> int:
        """Where the last sampled token goes when it is fed back."""
        return len(self.prompt_ids) + len(self.token_ids) - 1

    def add(self, token: int, context: int) -> None:
        """Take the next sampled token; `context`: the cache entries a row has."""
        if token in self.stop_ids:
            return self._end("stop")
        self.token_ids.append(token)
        self._extend(self._text.add(token))
        if self.finish_reason is None:
            if len(self.token_ids) >= self.params.max_tokens or len(self.prompt_ids) + len(self.token_ids) >= context:
                return self._end("length")
            self._emit(len(self.text) - self._hold)

    def finish(self, reason: str, error: str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason, self.error = reason, error
            self._emit(len(self.text))

    def _extend(self, new: str) -> None:
        """Add final text; finish at a stop string, the text cut before it."""
        searched_from = max(0, len(self.text) - self._hold)
        self.text += new
        for stop in self.params.stop:
            at = self.text.find(stop, searched_from)
            if at >= 0:
                self.text = self.text[:at]
                return self.finish("stop")

    def _end(self, reason: str) -> None:
        """No more tokens: their last text, then finish (at a stop string, if that text has one)."""
        self._extend(self._text.flush())
        self.finish(reason)

    def _emit(self, final: int) -> None:
        """Tell `on_update` of every token (with the text that became final, maybe none)."""
        if self.on_update is not None:
            new, self._sent = self.text[self._sent : max(final, self._sent)], max(final, self._sent)
            self.on_update(self, new)
