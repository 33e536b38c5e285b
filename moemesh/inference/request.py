"""One generation request as it runs: its settings, the tokens it has sampled (with their
log-probabilities when asked), their text, and when it stops — at the end-of-document token or
another stop token (not part of the text), at `max_tokens`, at the end of the context, or at a stop
string (the text ends before it) — with what it streams on the way.

Text is released only once it is final: a token can end inside a UTF-8 character (the byte
tokenizer) or change how the tokens before it read (Hugging Face decoders), so the newest tokens
are decoded again with the few before them until they read as whole characters (vLLM's
incremental detokenisation; each token costs two decodes of a short window). While a request
has stop strings, the last len(longest stop) − 1 characters are held back from the stream, since
they may be the start of one.

Both of `serve`'s processes read this module, and the HTTP one imports no torch (front.py), so
what both need lives here and not in the engine's modules: the engine's per-row `Sampling`,
`QueueFull` (the scheduler raises it, the HTTP side answers 503), `prompt_ids`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import MoemeshError, RequestError

SEED_MODULUS = 2**63  # a seed is taken modulo this: any integer fits the engine's int64 seeds
MAX_LOGPROBS = 20  # alternatives per token, at most (OpenAI's limit for chat)


class QueueFull(MoemeshError):
    """Every row is busy and the waiting queue is at its limit (the server's 503)."""


@dataclass(frozen=True)
class Sampling:
    """A row's sampling in the engine's step (`SamplingParams.sampling`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt_logprobs: the prompt's log-probabilities alone
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0  # any integer (taken modulo 2**63)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end the request like the end-of-document token (a chat turn's end)
    # Logits processing (processing.py), OpenAI's and Hugging Face's semantics:
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # per generated token: its log-probability and this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (after the first)
    grammar: str | None = None  # an llguidance grammar (grammar.py) that the text must follow
    skip_special_tokens: bool = True  # False: special tokens' text kept (the output parsers read their markers)

    def check(self, vocab: int | None = None) -> None:
        """A RequestError naming the first field out of range (token ids against `vocab` when given)."""

        def is_int(value):
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value):
            try:
                return (is_int(value) or isinstance(value, float)) and math.isfinite(value)
            except OverflowError:  # an integer beyond any float
                return False

        def token_ids_ok(ids):
            return all(is_int(i) and i >= 0 and (vocab is None or i < vocab) for i in ids)

        least = 0 if self.prompt_logprobs is not None else 1
        if not is_int(self.max_tokens) or self.max_tokens < least:
            raise RequestError(
                f"max_tokens must be an integer >= {least}, got {short(self.max_tokens)}",
                "max_tokens",
            )
        if not is_number(self.temperature) or self.temperature < 0:
            raise RequestError(
                f"temperature must be a finite number >= 0, got {short(self.temperature)}", "temperature"
            )
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {short(self.top_p)}", "top_p")
        if not is_int(self.seed):
            raise RequestError(f"seed must be an integer, got {short(self.seed)}", "seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise RequestError(f"stop must be non-empty strings, got {short(self.stop)}", "stop")
        if not isinstance(self.stop_token_ids, tuple) or not token_ids_ok(self.stop_token_ids):
            raise RequestError(
                f"stop_token_ids must be token ids in [0, {vocab}), got {short(self.stop_token_ids)}", "stop_token_ids"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {short(value)}", name)
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(
                f"repetition_penalty must be a number > 0, got {short(self.repetition_penalty)}", "repetition_penalty"
            )
        for token, bias in self.logit_bias:
            if not token_ids_ok([token]):
                raise RequestError(f"logit_bias: {short(token)} is not a token id in [0, {vocab})", "logit_bias")
            if not is_number(bias) or not -100 <= bias <= 100:
                raise RequestError(f"logit_bias: the bias of token {token} must be in [-100, 100]", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise RequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {short(value)}", name)

    @functools.cached_property  # read for every running row at every step
    def sampling(self) -> Sampling:
        return Sampling(float(self.temperature), float(self.top_p), self.seed % SEED_MODULUS)

    @functools.cached_property
    def processed(self) -> bool:
        """Whether the request needs more than the engine's own sampling (processing.py)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
            or self.logprobs is not None
            or self.grammar is not None
        )


def short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters and ASCII-only (an error message quotes user input)."""
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The token ids of a prompt, after the end-of-document token."""
    check_text(prompt, "prompt", escaped_bytes=True)  # a command line's undecodable bytes arrive as lone surrogates
    ids = ([] if tokenizer.eos_id is None else [tokenizer.eos_id]) + tokenizer.encode(prompt)
    if not ids:
        raise RequestError("the prompt is empty and the tokenizer has no end-of-document token to start from", "prompt")
    return ids


def check_text(text: str, param: str, escaped_bytes: bool = False) -> None:
    """A RequestError unless `text` is valid Unicode, naming the first lone surrogate (JSON's
    "\\ud800") and its character position; with `escaped_bytes` (a command line's text, whose
    undecodable bytes Python carries as U+DC80..U+DCFF) such a character is named as its byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        if escaped_bytes and 0xDC80 <= code <= 0xDCFF:
            message = (
                f"{param} is not UTF-8 text: the byte 0x{code - 0xDC00:02x} at character {e.start} is not valid UTF-8"
            )
        else:
            message = f"{param} is not valid Unicode: a lone surrogate U+{code:04X} at character {e.start}"
        raise RequestError(message, param) from None


def check_request(prompt_ids: list[int], params: SamplingParams, context: int, vocab: int | None = None) -> None:
    """A RequestError unless the request can run in a cache row of `context` entries (its token
    ids, the prompt's included, in [0, vocab) when `vocab` is given)."""
    params.check(vocab)
    if not prompt_ids:
        raise RequestError("the prompt is empty", "prompt")
    if vocab is not None and not all(isinstance(i, int) and 0 <= i < vocab for i in prompt_ids):
        bad = next(i for i in prompt_ids if not (isinstance(i, int) and 0 <= i < vocab))
        raise RequestError(f"the prompt's token id {short(bad)} is not in [0, {vocab})", "prompt")
    if len(prompt_ids) >= context:
        raise RequestError(
            f"the prompt has {len(prompt_ids)} tokens; the context holds {context} "
            "(the prompt and at least one new token)",
            "prompt",
        )


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read] is the context for decoding what follows

    def add(self, token: int) -> str:
        """Append a token; return the text that became final (maybe "")."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return now[len(before) :]

    def flush(self) -> str:
        """Whatever is left, as it reads now (at the end of the request)."""
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return now[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.skip else self.tokenizer.decode(ids, skip_special_tokens=False)


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and the `k` likeliest tokens' (ids, log-probabilities), best first,
    under the distribution it was drawn from (processing.py says which)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def mean_logprob(logprobs: list[Logprob]) -> float:
    """The mean log-probability of a sequence's tokens (best_of ranks by it, as OpenAI does)."""
    return sum(p.logprob for p in logprobs) / max(len(logprobs), 1)


class Sequence:
    """A request in the scheduler. `on_update(sequence, new_text)` runs on the scheduler's
    thread for every token sampled (new_text: what became final, maybe "") and once more when
    the request finishes. With params.logprobs, `logprobs[i]` goes with `token_ids[i]` and
    `offsets[i]` is where that token's text starts in `text` (the characters final before it);
    with params.prompt_logprobs, `prompt_logprobs[i]` goes with `prompt_ids[i]` (None for the
    first, which nothing precedes)."""

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
        self.logprobs: list[Logprob] = []
        self.offsets: list[int] = []
        self.prompt_logprobs: list[Logprob | None] = []
        self.text = ""
        self.finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
        self.error: str | None = None
        self.row: int | None = None  # the cache row while it runs
        self.cancelled = False  # set from any thread; the scheduler drops the request at its next step
        self.on_update = on_update
        self.sampler = None  # processing.RowSampler, when the request needs one (the scheduler's)
        # position -> the experts each MoE layer chose for that token, [layers, k] (the
        # scheduler's record_routing)
        self.routing: dict = {}
        self._text = IncrementalText(tokenizer, params.skip_special_tokens)
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._sent = 0

    @property
    def position(self) -> int:
        """Where the last sampled token goes when it is fed back."""
        return len(self.prompt_ids) + len(self.token_ids) - 1

    def add(self, token: int, context: int, logprob: Logprob | None = None) -> None:
        """Take the next sampled token; `context`: the cache entries a row has."""
        if token in self.stop_ids:
            return self._end("stop")
        self.token_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.offsets.append(len(self.text))
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
