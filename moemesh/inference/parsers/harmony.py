"""gpt-oss's harmony format (`--tool-call-parser harmony`, which reads its reasoning too): the
reply is messages, each a header and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>                                                      (on one line)

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.

(the template's generation prompt ends with `<|start|>assistant`, so the first header starts at
the reply's start). The `analysis` channel is reasoning, `final` is content, a `commentary`
message to `functions.NAME` (the recipient in the header, before or after the channel) is a call
whose body is its JSON arguments, and a commentary without a recipient (a preamble) is content.
`<|call|>` and `<|return|>` end a turn (the server stops at them, so they are often not in the
text): the text's end ends the last message as they do. A call whose body is not a JSON object
is content; so is a header that never reaches `<|message|>`. Recipients other than `functions.*`
(the built-in `browser` and `python` tools) are content: this server runs no built-in tool.
"""

from __future__ import annotations

import json
import re

from moemesh.inference.parsers.base import Event, Parser, arguments_json, first_marker, held_suffix, merged

START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN = (
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|call|>",
    "<|return|>",
    "<|constrain|>",
)
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
ENDS = (END, CALL, RETURN)
TURN_ENDS = (CALL, RETURN)  # tokens that end the reply (besides the tokenizer's eos)
_RECIPIENT = re.compile(r"to=([^\s<]+)")


class Harmony(Parser):
    def __init__(self, calls: bool = True):
        self.calls = calls  # False: a call is content (the request has no tools)
        self.pending, self.header, self.body = "", "", ""
        self.in_body = False
        self.kind = "content"  # the body's: content | reasoning | call
        self.name = ""

    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        while True:
            if not self.in_body:
                at = self.pending.find(MESSAGE)
                if at < 0:
                    keep = held_suffix(self.pending, (MESSAGE,))
                    self.header += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out
                self.header += self.pending[:at]
                self.pending = self.pending[at + len(MESSAGE) :]
                self._open()
                continue
            found = first_marker(self.pending, ENDS)
            if found is None:
                cut = len(self.pending) - held_suffix(self.pending, ENDS)
                out += self._text(self.pending[:cut])
                self.pending = self.pending[cut:]
                return out
            at, marker = found
            out += self._text(self.pending[:at]) + self._close()
            self.pending = self.pending[at + len(marker) :]

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.in_body:
            out += self._text(self.pending) + self._close()
        elif (self.header + self.pending).strip():  # a header that never became a message: text
            out.append(("content", self._strip_header(self.header + self.pending)))
        self.pending = self.header = ""
        return merged(out)

    def _open(self) -> None:
        header, self.header = self.header, ""
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        channel = channel.split()[0] if channel.split() else ""
        recipient = _RECIPIENT.search(header)
        self.in_body, self.body, self.name = True, "", ""
        if channel == "analysis":
            self.kind = "reasoning"
        elif recipient and recipient.group(1).startswith("functions.") and self.calls:
            self.kind, self.name = "call", recipient.group(1)[len("functions.") :]
        else:
            self.kind = "content"

    def _text(self, text: str) -> list[Event]:
        if self.kind == "call":
            self.body += text
            return []
        return [(self.kind, text)] if text else []

    def _close(self) -> list[Event]:
        self.in_body = False
        if self.kind != "call":
            return []
        body, self.body = self.body, ""
        try:
            arguments = arguments_json(json.loads(body)) if body.strip() else "{}"
        except (ValueError, RecursionError):
            arguments = None
        if arguments is None or not self.name:
            return [("content", body)]
        return [("call", self.name), ("arguments", arguments)]

    @staticmethod
    def _strip_header(text: str) -> str:
        for marker in MARKERS:
            text = text.replace(marker, "")
        return text
