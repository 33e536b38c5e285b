"""Which parsers read a served model's replies, by name (`serve --tool-call-parser`,
`--reasoning-parser`) or chosen from its chat template's markers and its model type; and
`Output`, one choice's parsing: reasoning first, then the tool calls of the answer.

Chosen from the template when it names a format's markers (the template decides the format, as
it decides the prompt), else from the model type: qwen3* -> hermes + qwen3, deepseek_v3 ->
deepseek_v3 (+ deepseek_r1 when the template writes `<think>`), gpt_oss -> harmony (it reads its
reasoning too), mixtral / mistral -> mistral, gemma4 -> gemma4. A model none of them fits has
no parser: tools are rendered by its template, and its replies are content.
"""

from __future__ import annotations

from collections.abc import Callable

from moemesh.inference.parsers.base import Event, Parser, merged
from moemesh.inference.parsers.deepseek import CALLS_BEGIN, DeepSeekV3
from moemesh.inference.parsers.gemma4 import Gemma4
from moemesh.inference.parsers.harmony import Harmony
from moemesh.inference.parsers.hermes import Hermes
from moemesh.inference.parsers.mistral import Mistral
from moemesh.inference.parsers.think import Think

TOOL_CALL_PARSERS: dict[str, Callable[[], Parser]] = {
    "hermes": Hermes,
    "deepseek_v3": DeepSeekV3,
    "mistral": Mistral,
    "gemma4": Gemma4,
    "harmony": Harmony,
}
REASONING_PARSERS = ("qwen3", "deepseek_r1", "harmony")
NONE = "none"  # names no parser (to turn the chosen one off)


def choose(model_type: str | None, template: str | None) -> tuple[str | None, str | None]:
    """(tool-call parser, reasoning parser) for a model type and its chat template's source."""
    template, model_type = template or "", model_type or ""
    if "<|channel|>" in template or model_type == "gpt_oss":
        return "harmony", "harmony"
    thinks = "<think>" in template or "</think>" in template
    for marker, name, reasoning in (
        ("<tool_call>", "hermes", "qwen3"),
        (CALLS_BEGIN, "deepseek_v3", "deepseek_r1"),
        ("<|tool_call>", "gemma4", None),
        ("[TOOL_CALLS]", "mistral", None),
    ):
        if marker in template:
            return name, reasoning if thinks else None
    if model_type.startswith("qwen3"):
        return "hermes", "qwen3" if thinks or not template else None
    by_type = {"deepseek_v3": ("deepseek_v3", "deepseek_r1"), "mixtral": ("mistral", None)}
    by_type |= {"mistral": ("mistral", None), "gemma4": ("gemma4", None), "gemma4_text": ("gemma4", None)}
    name, reasoning = by_type.get(model_type, (None, None))
    return name, reasoning if reasoning and thinks else None


class Output(Parser):
    """One choice's reply read into events: its reasoning apart, then the answer's tool calls
    (`tools` None: the answer is content). Harmony reads both at once."""

    def __init__(self, reasoning: Parser | None, tools: Parser | None):
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> list[Event]:
        events = self.reasoning.feed(text) if self.reasoning is not None else [("content", text)]
        return merged(self._answer(events))

    def finish(self) -> list[Event]:
        events = self.reasoning.finish() if self.reasoning is not None else []
        out = self._answer(events)
        if self.tools is not None:
            out += self.tools.finish()
        return merged(out)

    def _answer(self, events: list[Event]) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for kind, value in events:
            out += self.tools.feed(value) if kind == "content" else [(kind, value)]
        return out


def output(
    tool_parser: str | None,
    reasoning_parser: str | None,
    *,
    tools: bool,
    reasoning_open: bool,
    forced: Callable[[], Parser] | None = None,
) -> Output:
    """A choice's parsing: `forced` (tool_choice named / required) reads the answer when given,
    else the tool-call parser when the request has tools."""
    if forced is None and "harmony" in (tool_parser, reasoning_parser):
        return Output(Harmony(calls=tools and tool_parser == "harmony"), None)
    reasoning = Think(reasoning_open) if reasoning_parser in ("qwen3", "deepseek_r1") and forced is None else None
    if forced is not None:
        answer = forced()
    elif tools and tool_parser in TOOL_CALL_PARSERS:
        answer = TOOL_CALL_PARSERS[tool_parser]()
    else:
        answer = None
    return Output(reasoning, answer)
