"""Mistral's tool calls (`--tool-call-parser mistral`), Mixtral's and Mistral's, in both of its
tokenizers' forms after the `[TOOL_CALLS]` token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]      (v3 to v7)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                   (v11 and later)

(and `NAME[CALL_ID]id[ARGS]{...}`, whose id is not kept: ids are the server's). A call ends where
its JSON ends, so it is reported then, not at the next marker or the end of the text. A list's
calls are reported together, at the list's end.
"""

from __future__ import annotations

import json

from moemesh.inference.parsers.base import Delimited, JsonEnd, arguments_json

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME_MAX = 64


class Mistral(Delimited):
    starts = (TOOL_CALLS,)

    def begin(self) -> None:
        self._json, self._json_at = None, None

    def end(self, body: str):
        if self._json_at is None:
            stripped = body.lstrip()
            if not stripped:
                return None
            if stripped[:1] in ("[", "{"):
                self._json_at = len(body) - len(stripped)
                self._json = JsonEnd(self._json_at)
            else:
                # a name is one short word: a newline, or 64 characters, before [ARGS] is not a call
                # (the text up to there is content, and what follows is read again)
                at, limit = body.find(ARGS), min(len(body), _NAME_MAX)
                newline = body.find("\n", 0, limit)
                limit = newline if newline >= 0 else limit
                if at < 0 or at > limit:
                    return (limit, limit) if newline >= 0 or len(body) >= _NAME_MAX else None
                self._json_at = at + len(ARGS)
                self._json = JsonEnd(self._json_at)
        stop = self._json.scan(body)
        if stop is None:
            return None
        stop = self._json_at if stop < 0 else stop  # not JSON after [ARGS]: content from there
        return stop, stop

    def calls(self, marker: str, body: str):
        stripped = body.strip()
        if stripped.startswith(("[", "{")):
            value = json.loads(stripped)
            items = value if isinstance(value, list) else [value]
            out = []
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                    return None
                arguments = item.get("arguments", {})
                if isinstance(arguments, str):  # some fine-tunes write the arguments as a JSON string
                    arguments = json.loads(arguments)
                arguments = arguments_json(arguments)
                if arguments is None:
                    return None
                out.append((item["name"], arguments))
            return out
        if ARGS not in body:
            return None
        name, arguments = body.split(ARGS, 1)
        name = name.split(CALL_ID, 1)[0].strip()
        arguments = arguments_json(json.loads(arguments))
        if not name or any(c.isspace() for c in name) or arguments is None:
            return None
        return [(name, arguments)]
