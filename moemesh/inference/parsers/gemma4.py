"""Gemma-4's tool calls (`--tool-call-parser gemma4`): `<|tool_call>call:NAME{ARGS}<tool_call|>`,
where ARGS is Gemma's own notation, not JSON — keys bare, strings between `<|"|>` marks, numbers,
`true` / `false` / `null`, nested `{...}` and `[...]`:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

read into a JSON object. Calls follow each other with no separator. A bare word that is not a
number or a literal is read as a string (as Google's own reader does); anything else that does
not read is content.
"""

from __future__ import annotations

import json
import re

from moemesh.inference.parsers.base import Delimited

START, END, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([A-Za-z0-9_.\-]+)\{")


class Gemma4(Delimited):
    starts = (START,)
    end_marker = END

    def calls(self, marker: str, body: str):
        head = _HEAD.match(body)
        if head is None:
            return None
        value, at = _Reader(body).value(head.end() - 1)
        if body[at:].strip() or not isinstance(value, dict):
            return None
        return [(head.group(1), json.dumps(value, ensure_ascii=False))]


class _Reader:
    """Gemma's notation, recursive descent; ValueError where it does not read."""

    def __init__(self, text: str):
        self.text = text

    def _space(self, at: int) -> int:
        while at < len(self.text) and self.text[at].isspace():
            at += 1
        return at

    def value(self, at: int):
        text, at = self.text, self._space(at)
        if text.startswith(QUOTE, at):
            close = text.find(QUOTE, at + len(QUOTE))
            if close < 0:
                raise ValueError("an open string")
            return text[at + len(QUOTE) : close], close + len(QUOTE)
        if text.startswith("{", at):
            out, at = {}, self._space(at + 1)
            while not text.startswith("}", at):
                if text.startswith(QUOTE, at):
                    key, at = self.value(at)
                else:
                    colon = text.find(":", at)
                    if colon < 0:
                        raise ValueError("a key without a value")
                    key, at = text[at:colon].strip(), colon
                    if not key or any(c in key for c in '{}[],"'):
                        raise ValueError("not a key")
                at = self._space(at)
                if not text.startswith(":", at):
                    raise ValueError("a key without ':'")
                out[key], at = self.value(at + 1)
                at = self._after_item(at, "}")
            return out, at + 1
        if text.startswith("[", at):
            items, at = [], self._space(at + 1)
            while not text.startswith("]", at):
                item, at = self.value(at)
                items.append(item)
                at = self._after_item(at, "]")
            return items, at + 1
        end = at
        while end < len(text) and text[end] not in ",}]":
            end += 1
        word = text[at:end].strip()
        if not word:
            raise ValueError("a missing value")
        try:
            return json.loads(word), end
        except ValueError:
            return word, end

    def _after_item(self, at: int, close: str) -> int:
        at = self._space(at)
        if self.text.startswith(",", at):
            return self._space(at + 1)
        if not self.text.startswith(close, at):
            raise ValueError(f"expected ',' or {close!r}")
        return at
