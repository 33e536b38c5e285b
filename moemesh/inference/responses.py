"""OpenAI's response objects for a Plan's sequences (protocol.py): a whole completion or chat
completion, the chunks of a stream and its usage chunk, with log-probabilities in each API's
shape — completions: tokens, token_logprobs, top_logprobs (the k likeliest and the chosen token)
and text_offset (where each token's text starts in the choice's text, the echoed prompt
included); chat: content = [{token, logprob, bytes, top_logprobs}].

With best_of > n the n sequences of each prompt with the highest mean token log-probability are
the choices (OpenAI's rule); usage counts every sequence's tokens, the others' too. A prompt's
tokens count once in usage however many choices it has, as OpenAI and vLLM count them.

A chat reply whose plan has an output parser (plan.output: the family's tool calls and reasoning,
parsers/) is read by it: the message's `content` is the answer, `reasoning_content` and
`reasoning` (SGLang's and vLLM's names, the same text) the thinking, and `tool_calls` OpenAI's
`{id, type: "function", function: {name, arguments}}` with `finish_reason: "tool_calls"` when the
model stopped after calling. Streamed, each event is a chunk: a call's first chunk carries its
index, id, type and whole name, the next its arguments; the chunk of a token carries its
log-probabilities (the first of its chunks), and the last its finish_reason.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from moemesh.data.tokenizer import Tokenizer
from moemesh.inference.protocol import Plan
from moemesh.inference.request import IncrementalText, Logprob, Sequence, mean_logprob


class Reply:
    def __init__(self, model: str, plan: Plan, sequences: list[Sequence], tokenizer: Tokenizer):
        self.model, self.plan, self.sequences, self.tokenizer = model, plan, sequences, tokenizer
        self.chat = plan.chat
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._strings: dict[int, str] = {}
        self._parsed: dict[int, Parsed] = {}

    def parsed(self, index: int) -> Parsed | None:
        """Sequence `index`'s reading by the plan's output parsers (None: its text is the content)."""
        if self.plan.output is None:
            return None
        if index not in self._parsed:
            self._parsed[index] = Parsed(self.plan.output(), self.plan.one_call)
        return self._parsed[index]

    def _head(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion" + (".chunk" if chunk else "")) if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def usage(self) -> dict[str, int]:
        prompt = sum(len(ids) for ids in self.plan.prompts)
        completion = sum(len(s.token_ids) for s in self.sequences)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def prompt_of(self, index: int) -> int:
        """The prompt of sequence `index` (best_of of them a prompt)."""
        return index // self.plan.best_of

    # ---- whole -------------------------------------------------------------------------------------
    def chosen(self) -> list[Sequence]:
        """n sequences a prompt, in choice order."""
        best_of, n = self.plan.best_of, self.plan.n
        out = []
        for p in range(len(self.plan.prompts)):
            group = self.sequences[p * best_of : (p + 1) * best_of]
            out += sorted(group, key=lambda s: -mean_logprob(s.logprobs))[:n] if best_of > n else group
        return out

    def whole(self) -> dict:
        choices = []
        for index, sequence in enumerate(self.chosen()):
            p = index // self.plan.n
            if self.chat:
                message, reason = {"role": "assistant", "content": sequence.text}, sequence.finish_reason
                if self.plan.output is not None:
                    message, reason = Parsed(self.plan.output(), self.plan.one_call).whole(
                        sequence.text, reason, self.plan.reasoning
                    )
                choice = {
                    "index": index,
                    "message": message,
                    "finish_reason": reason,
                    "logprobs": self.chat_logprobs(sequence.token_ids, sequence.logprobs),
                }
            else:
                echo = self.plan.echo_texts[p] if self.plan.echo else ""
                choice = {
                    "index": index,
                    "text": echo + sequence.text,
                    "finish_reason": sequence.finish_reason,
                    "logprobs": self.completion_logprobs(sequence, 0, len(sequence.token_ids), p, with_prompt=True),
                }
            choices.append(choice)
        return {**self._head(False), "choices": choices, "usage": self.usage()}

    # ---- streamed ----------------------------------------------------------------------------------
    def first_events(self) -> list[str]:
        """Chat streams start with each choice's role."""
        if not self.chat:
            return []
        return [self._event(i, {"role": "assistant", "content": ""}, None, None) for i in range(len(self.sequences))]

    def event(self, index: int, text: str, reason: str | None, tokens: tuple[int, int], first: bool) -> str:
        """Sequence `index`'s chunk: its new final text and the tokens [start, end) it took since the
        last chunk (their log-probabilities when asked); the first carries the echo."""
        sequence, p = self.sequences[index], self.prompt_of(index)
        if self.chat:
            logprobs = self.chat_logprobs(sequence.token_ids[slice(*tokens)], sequence.logprobs[slice(*tokens)])
            parsed = self.parsed(index)
            if parsed is None:
                return self._event(index, {"content": text} if text else {}, reason, logprobs)
            deltas, reason = parsed.deltas(text, reason)
            deltas = deltas or [{}]
            return "".join(
                self._event(index, delta, reason if i == len(deltas) - 1 else None, logprobs if i == 0 else None)
                for i, delta in enumerate(deltas)
            )
        echo = self.plan.echo_texts[p] if self.plan.echo and first else ""
        logprobs = self.completion_logprobs(sequence, *tokens, p, with_prompt=first)
        return self._event(index, echo + (text or ""), reason, logprobs)

    def _event(self, index: int, content, reason: str | None, logprobs) -> str:
        if self.chat:
            choice = {"index": index, "delta": content, "finish_reason": reason, "logprobs": logprobs}
        else:
            choice = {"index": index, "text": content, "finish_reason": reason, "logprobs": logprobs}
        return _sse({**self._head(True), "choices": [choice]})

    def usage_event(self) -> str:
        return _sse({**self._head(True), "choices": [], "usage": self.usage()})

    def error_event(self, error) -> str:
        """A stream's last event when its generation failed: the error object (an ApiError's)."""
        return "data: " + json.dumps(error.body()) + "\n\n"

    def last_events(self, include_usage: bool) -> list[str]:
        return ([self.usage_event()] if include_usage else []) + ["data: [DONE]\n\n"]

    # ---- log-probabilities -------------------------------------------------------------------------
    def string(self, token: int) -> str:
        if token not in self._strings:
            self._strings[token] = self.tokenizer.decode([token])
        return self._strings[token]

    def completion_logprobs(self, sequence: Sequence, start: int, end: int, p: int, with_prompt: bool) -> dict | None:
        if self.plan.logprobs is None:
            return None
        tokens, logprobs, offsets = [], [], []
        shift = 0
        if self.plan.echo:
            shift = len(self.plan.echo_texts[p])
            if with_prompt:
                prompt = self.plan.prompts[p]
                tokens, logprobs = list(prompt), list(sequence.prompt_logprobs or [None] * len(prompt))
                offsets = _offsets(self.tokenizer, prompt)
        tokens += sequence.token_ids[start:end]
        logprobs += sequence.logprobs[start:end]
        offsets += [shift + o for o in sequence.offsets[start:end]]
        if not tokens:
            return None
        return {
            "tokens": [self.string(t) for t in tokens],
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else self._top(t, lp) for t, lp in zip(tokens, logprobs)],
            "text_offset": offsets,
        }

    def _top(self, token: int, logprob: Logprob) -> dict[str, float]:
        top = {self.string(i): v for i, v in logprob.top[: self.plan.logprobs]}
        top.setdefault(self.string(token), logprob.logprob)  # the chosen token always (OpenAI: up to k + 1)
        return top

    def chat_logprobs(self, tokens: list[int], logprobs: list[Logprob]) -> dict | None:
        if self.plan.logprobs is None:
            return None

        def entry(token: int, value: float) -> dict:
            text = self.string(token)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        content = [
            {**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top[: self.plan.logprobs]]}
            for t, lp in zip(tokens, logprobs)
        ]
        return {"content": content, "refusal": None}


class Parsed:
    """One chat choice read by its output parser: the whole message, or a stream's deltas."""

    def __init__(self, parser, one_call: bool):
        self.parser, self.one_call = parser, one_call
        self.calls = 0
        self.dropping = False  # a call past the first, with parallel_tool_calls false

    def _keep(self, events):
        for kind, value in events:
            if kind == "call":
                self.dropping = self.one_call and self.calls >= 1
                if self.dropping:
                    continue
                self.calls += 1
            elif kind == "arguments" and self.dropping:
                continue
            yield kind, value

    def _reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def whole(self, text: str, reason: str | None, reasoning: bool) -> tuple[dict, str | None]:
        content, thinking, calls = [], [], []
        for kind, value in self._keep(self.parser.feed(text) + self.parser.finish()):
            if kind == "content":
                content.append(value)
            elif kind == "reasoning":
                thinking.append(value)
            elif kind == "call":
                calls.append({"id": _call_id(), "type": "function", "function": {"name": value, "arguments": ""}})
            else:
                calls[-1]["function"]["arguments"] += value
        message = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
        if reasoning:
            message["reasoning_content"] = message["reasoning"] = "".join(thinking) or None
        if calls:
            message["tool_calls"] = calls
        return message, self._reason(reason)

    def events(self, text: str, final: bool) -> list[tuple[str, str]]:
        """The events of the next piece of text (and of the end, when `final`), the calls past the
        first dropped with parallel_tool_calls false."""
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return list(self._keep(events))

    def deltas(self, text: str, reason: str | None) -> tuple[list[dict], str | None]:
        out = []
        for kind, value in self.events(text, reason is not None):
            if kind == "content":
                out.append({"content": value})
            elif kind == "reasoning":
                out.append({"reasoning_content": value, "reasoning": value})
            elif kind == "call":
                call = {"index": self.calls - 1, "id": _call_id(), "type": "function"}
                out.append({"tool_calls": [{**call, "function": {"name": value, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": value}}]})
        return out, self._reason(reason)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _offsets(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Where each token's text starts in the text of `ids` (the characters final before it)."""
    text, length, offsets = IncrementalText(tokenizer), 0, []
    for token in ids:
        offsets.append(length)
        length += len(text.add(token))
    return offsets


def _sse(data: dict) -> str:
    return "data: " + json.dumps(data, ensure_ascii=False) + "\n\n"
