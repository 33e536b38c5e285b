"""What every output parser shares: the events it reports, and the streaming machine of the
formats whose calls sit between markers in the text (Hermes, DeepSeek, Mistral, Gemma-4).

A parser is fed a choice's text as it becomes final, a piece at a time, and answers with events:

    ("content", text)      the answer's text
    ("reasoning", text)    the model's thinking, apart from the answer
    ("call", name)         a new tool call (its index: the calls before it), with its whole name
    ("arguments", text)    a fragment of the last call's arguments, a JSON text

`finish()` says the text has ended. Reading a text whole is feeding it in one piece: the events
are the same however the text is split (tests feed every split), so a stream's deltas add up to
the whole response. Text that may begin a marker is held back until the next piece says whether
it does. A call is reported once its end is seen (its end marker, the end of its JSON, or the
end of the text) and its body parsed: a body that does not parse is content, as the model wrote
it — never an error. So its arguments come in one fragment, re-serialized compactly
(`json.dumps`), not token by token: the price of never retracting a call already sent.

Cost: each piece is searched once for the markers (str.find on what is pending); a call's body
is scanned for its end from where the last scan stopped and parsed once. Nothing is re-parsed
from the start of the text.

A run of whitespace outside calls that touches a call (before the first, between two, after the
last) is dropped: the newlines a model writes around its calls are not content.
"""

from __future__ import annotations

import json

Event = tuple[str, str]


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the start of a marker (but not a whole one):
    for each marker, only where its first character occurs among the last characters is looked at."""
    longest = 0
    for marker in markers:
        low = max(0, len(text) - len(marker) + 1)
        at = text.rfind(marker[0], low)
        while at >= 0:
            if len(text) - at > longest and marker.startswith(text[at:]):
                longest = len(text) - at
            at = text.rfind(marker[0], low, at)
    return longest


def first_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """(where, which) of the earliest marker in text[start:], or None."""
    best = None
    for marker in markers:
        at = text.find(marker, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    return best


def arguments_json(value) -> str | None:
    """A call's arguments as OpenAI sends them: a JSON object's text (None if not an object)."""
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def merged(events: list[Event]) -> list[Event]:
    """Adjacent text events of one kind as one (and no empty text)."""
    out: list[Event] = []
    for kind, value in events:
        if kind in ("content", "reasoning", "arguments") and not value:
            continue
        if out and kind == out[-1][0] and kind in ("content", "reasoning", "arguments"):
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return out


class Parser:
    """The interface (and a parser that parses nothing: all text is content)."""

    def feed(self, text: str) -> list[Event]:
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        return []


def parse_whole(parser: Parser, text: str) -> list[Event]:
    """A whole text's events (what a stream of it adds up to)."""
    return merged(parser.feed(text) + parser.finish())


class JsonDepth:
    """The bracket depth of a JSON text fed a character at a time, strings and escapes respected."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escape = False

    def step(self, c: str) -> int:
        """+1 at an opening bracket outside strings, -1 at a closing one, else 0 (depth kept)."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
            return 0
        if c == '"':
            self.in_string = True
            return 0
        if c in "{[":
            self.depth += 1
            return 1
        if c in "}]":
            self.depth -= 1
            return -1
        return 0


class JsonEnd(JsonDepth):
    """Where a JSON object or array that starts in a text ends, scanned a character at a time
    from where the last call stopped (strings and escapes respected; scalars are not values here)."""

    def __init__(self, start: int = 0):
        super().__init__()
        self.pos, self.started = start, False

    def scan(self, text: str) -> int | None:
        """The index just past the value's end, or None while it has not ended; -1 when the text
        does not start (after spaces, from `start`) with an object or an array."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if not (self.started or self.in_string or c.isspace() or c in '"{}[]'):
                return -1
            moved = self.step(c)
            if moved > 0:
                self.started = True
            elif moved < 0 and self.depth <= 0:
                self.pos = i + 1
                return i + 1
        self.pos = len(text)
        return None


class _Runs:
    """The text between calls, with the whitespace-touching-a-call rule (module docstring)."""

    def __init__(self):
        self.held, self.visible, self.after_call = "", False, False

    def text(self, text: str) -> list[Event]:
        if self.visible:
            return [("content", text)] if text else []
        self.held += text
        if self.held.strip():
            self.visible, out, self.held = True, self.held, ""
            return [("content", out)]
        return []

    def call(self) -> None:
        self.held, self.visible, self.after_call = "", False, True

    def finish(self) -> list[Event]:
        out = [] if self.after_call or not self.held else [("content", self.held)]
        self.held = ""
        return out


class Delimited(Parser):
    """The streaming machine of calls that start at a marker: text outside them is content; a
    call's body runs to where `end` says, and `calls` reads it. A format says:

    starts    the markers that open a call
    dropped   markers removed from the content (a section's wrapper around its calls)
    end_marker  the marker that ends a call's body, where one does (else `begin` and `end`:)
    begin()   a new call's body starts (reset the end's scan)
    end(body) -> (body's end, where the text after it resumes) or None while not yet ended
    calls(marker, body) -> [(name, arguments JSON)], or None when the body does not parse
    """

    starts: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    end_marker: str | None = None

    def __init__(self):
        self.pending, self.marker = "", None  # the marker of the call whose body is pending
        self.runs = _Runs()
        self._end = MarkerEnd(self.end_marker) if self.end_marker is not None else None

    # ---- the format's --------------------------------------------------------------------------
    def begin(self) -> None:
        if self._end is not None:
            self._end.reset()

    def end(self, body: str) -> tuple[int, int] | None:
        if self._end is None:
            raise NotImplementedError
        return self._end(body)

    def calls(self, marker: str, body: str) -> list[tuple[str, str]] | None:
        raise NotImplementedError

    # ---- the machine -----------------------------------------------------------------------------
    def feed(self, text: str) -> list[Event]:
        self.pending += text
        out: list[Event] = []
        markers = self.starts + self.dropped
        while True:
            if self.marker is None:
                found = first_marker(self.pending, markers)
                if found is None:
                    keep = held_suffix(self.pending, markers)
                    cut = len(self.pending) - keep
                    out += self.runs.text(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    return out
                at, marker = found
                out += self.runs.text(self.pending[:at])
                self.pending = self.pending[at + len(marker) :]
                if marker in self.dropped:
                    self.runs.call()  # a section's wrapper touches calls as they do
                    continue
                self.marker = marker
                self.begin()
            ended = self.end(self.pending)
            if ended is None:
                return out
            stop, resume = ended
            out += self._call(self.pending[:stop], self.pending[:resume])
            self.pending = self.pending[resume:]

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.marker is not None:
            out += self._call(self.pending, self.pending)
        else:
            out += self.runs.text(self.pending)
        self.pending = ""
        return merged(out + self.runs.finish())

    def _call(self, body: str, raw: str) -> list[Event]:
        marker, self.marker = self.marker, None
        try:
            calls = self.calls(marker, body)
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            calls = None
        if not calls:  # not a call: the text as the model wrote it
            return self.runs.text(marker + raw)
        self.runs.call()
        out: list[Event] = []
        for name, arguments in calls:
            out += [("call", name), ("arguments", arguments)]
        return out


class MarkerEnd:
    """end() for a body that ends at a marker, searched from where the last search stopped."""

    def __init__(self, marker: str):
        self.marker, self.scanned = marker, 0

    def reset(self) -> None:
        self.scanned = 0

    def __call__(self, body: str) -> tuple[int, int] | None:
        at = body.find(self.marker, self.scanned)
        if at < 0:
            self.scanned = max(0, len(body) - len(self.marker) + 1)
            return None
        return at, at + len(self.marker)
