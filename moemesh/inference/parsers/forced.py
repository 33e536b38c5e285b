"""The replies that `tool_choice` forces through the grammar (protocol.py compiles it), in vLLM's
forms: a named function's reply is its arguments object alone, and `required`'s is a JSON list
`[{"name": ..., "parameters": {...}}, ...]`. They are the model's answer whatever its family.

Named: the call is reported at the reply's first text and its arguments streamed as they are
generated (the grammar keeps them valid; max_tokens can still cut them, as it cuts any JSON).
Required: each call is reported when its object in the list closes. A reply cut short is what
parsed of it (its complete calls); one that is not such a list at all is content.
"""

from __future__ import annotations

import json

from moemesh.inference.parsers.base import Event, JsonDepth, Parser, arguments_json, merged


class Named(Parser):
    def __init__(self, name: str):
        self.name, self.started = name, False

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        out = [] if self.started else [("call", self.name)]
        self.started = True
        return out + [("arguments", text)]

    def finish(self) -> list[Event]:
        return [] if self.started else [("call", self.name), ("arguments", "{}")]


class Required(Parser):
    """The list's items found by depth: an item is the text from a `{` at depth 1 to its `}`."""

    def __init__(self):
        self.text, self.pos, self.json = "", 0, JsonDepth()
        self.item_at: int | None = None
        self.calls = 0
        self.broken = False

    def feed(self, text: str) -> list[Event]:
        self.text += text
        out: list[Event] = []
        for i in range(self.pos, len(self.text)):
            c = self.text[i]
            moved = self.json.step(c)
            if moved > 0 and c == "{" and self.json.depth == 2:
                self.item_at = i
            elif moved < 0 and c == "}" and self.json.depth == 1 and self.item_at is not None:
                out += self._item(self.text[self.item_at : i + 1])
                self.item_at = None
        self.pos = len(self.text)
        return out

    def _item(self, item: str) -> list[Event]:
        try:
            value = json.loads(item)
            name, arguments = value["name"], arguments_json(value["parameters"])
        except (ValueError, KeyError, TypeError, RecursionError):
            name, arguments = None, None
        if not isinstance(name, str) or arguments is None:
            self.broken = True
            return []
        self.calls += 1
        return [("call", name), ("arguments", arguments)]

    def finish(self) -> list[Event]:
        if self.calls == 0 and self.text.strip():
            return merged([("content", self.text)])
        return []
