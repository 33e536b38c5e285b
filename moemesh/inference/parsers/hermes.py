"""Hermes-style tool calls, Qwen3's and Qwen2.5's (`--tool-call-parser hermes`): each call a JSON
object between `<tool_call>` and `</tool_call>`,

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`arguments` (or `parameters`, which some fine-tunes write) must be an object. A call cut before
its `</tool_call>` (max_tokens, or a model that ends its turn there) is a call when its JSON is
complete. Limits: one JSON object a call (not a list); Qwen3-Coder's XML form
(`<function=NAME><parameter=...>`) is another format, not read here.
"""

from __future__ import annotations

import json

from moemesh.inference.parsers.base import Delimited, arguments_json

START, END = "<tool_call>", "</tool_call>"


class Hermes(Delimited):
    starts = (START,)
    end_marker = END

    def calls(self, marker: str, body: str):
        value = json.loads(body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = arguments_json(value.get("arguments", value.get("parameters", {})))
        return None if arguments is None else [(value["name"], arguments)]
