"""The output parsers (moemesh/inference/parsers/) on fixed model outputs, one format at a time,
as vLLM's tests/tool_parsers/ test theirs: each text read whole, and streamed at every split of
it into two deltas, into three at a stride, and a character at a time — the events always add up
to the whole reading (so a stream's concatenated arguments are the non-streamed ones). Malformed
outputs are content, never an exception. These are pure functions of text: no model runs."""

from __future__ import annotations

import json
import random

import pytest

from moemesh.inference.parsers.base import merged, parse_whole
from moemesh.inference.parsers.forced import Named, Required
from moemesh.inference.parsers.registry import Output, choose, output
from moemesh.inference.parsers.think import opened_in_prompt

WEATHER = '{"city": "Paris", "days": 3}'


def _streamed(make, text: str, cuts: list[int]):
    parser, events, last = make(), [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[last:cut])
        last = cut
    return merged(events + parser.finish())


def check_every_split(make, text: str):
    """The whole reading, after checking that every split of `text` streams to it."""
    whole = parse_whole(make(), text)
    for i in range(len(text) + 1):
        assert _streamed(make, text, [i]) == whole, (i, text[:i])
    stride = max(1, len(text) // 12)
    for i in range(0, len(text) + 1, stride):
        for j in range(i, len(text) + 1, stride):
            assert _streamed(make, text, [i, j]) == whole, (i, j)
    assert _streamed(make, text, list(range(len(text)))) == whole
    rng = random.Random(0)
    for _ in range(20):
        assert _streamed(make, text, sorted(rng.choices(range(len(text) + 1), k=5))) == whole
    return whole


def tools_of(name: str, reasoning: str | None = None, open_: bool = False):
    return lambda: output(name, reasoning, tools=True, reasoning_open=open_)


def calls(events) -> list[tuple[str, dict]]:
    out = []
    for kind, value in events:
        if kind == "call":
            out.append([value, ""])
        elif kind == "arguments":
            out[-1][1] += value
    return [(name, json.loads(arguments)) for name, arguments in out]


def text_of(events, kind="content") -> str:
    return "".join(v for k, v in events if k == kind)


CASES = [
    # (parser, model output, content, calls)
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}\n</tool_call>\n"
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (  # cut before its end marker (max_tokens, or a model that ends its turn there): complete JSON is a call
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER + "}",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "deepseek_v3",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + WEATHER
        + "\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Sure.",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (  # V3.1's form
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        + WEATHER
        + "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + WEATHER + '}, {"name": "now", "arguments": {}}]',
        "",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (  # v11's form, with a call id (not kept)
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]" + WEATHER + "[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}",
        "",
        [("get_weather", {"city": "Paris", "days": 3}), ("now", {})],
    ),
    (
        "gemma4",
        'Checking. <|tool_call>call:get_weather{city:<|"|>Paris, FR<|"|>,days:3,hours:[6,<|"|>noon<|"|>],'
        "opts:{metric:true,limit:null}}<tool_call|><|tool_call>call:now{}<tool_call|>",
        "Checking. ",
        [
            (
                "get_weather",
                {"city": "Paris, FR", "days": 3, "hours": [6, "noon"], "opts": {"metric": True, "limit": None}},
            ),
            ("now", {}),
        ],
    ),
    (
        "harmony",
        "<|channel|>analysis<|message|>They want the weather.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>",
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (  # the recipient before the channel; the call's end not in the text (the server stops at <|call|>)
        "harmony",
        "<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.get_weather"
        "<|channel|>commentary json<|message|>" + WEATHER,
        "Looking it up.",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
]


@pytest.mark.parametrize("name, text, content, expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_format_whole_and_at_every_split(name, text, content, expected):
    events = check_every_split(tools_of(name), text)
    assert calls(events) == expected
    assert text_of(events) == content


MALFORMED = [
    ("hermes", "<tool_call>\n{not json}\n</tool_call> and then"),
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments must be an object
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": '),  # cut inside the JSON
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n{oops<｜tool▁call▁end｜>"),
    ("mistral", "[TOOL_CALLS] not a call at all, just text\nmore"),
    ("mistral", "[TOOL_CALLS]f[ARGS]nope"),
    ("gemma4", '<|tool_call>call:f{a:<|"|>open string}<tool_call|>'),
    ("gemma4", "<|tool_call>nonsense<tool_call|>"),
    ("harmony", "<|channel|>commentary to=functions.f<|message|>{broken"),
    ("harmony", "plain text, no harmony at all"),
]


@pytest.mark.parametrize("name, text", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_malformed_outputs_are_content(name, text):
    events = check_every_split(tools_of(name), text)
    assert calls(events) == [] and text_of(events).strip()


def test_plain_text_passes_through_unchanged():
    for name in ("hermes", "deepseek_v3", "mistral", "gemma4"):
        for text in ("def f():\n    return 1 < 2\n", "a <tool not a call", "  \n", "[TOOL"):
            assert text_of(check_every_split(tools_of(name), text)) == text


def test_whitespace_touching_calls_is_dropped_not_other_whitespace():
    a, b = ("<tool_call>" + json.dumps({"name": name, "arguments": {}}) + "</tool_call>" for name in "ab")
    text = f"\n\n{a}\n\n{b}\n"
    events = check_every_split(tools_of("hermes"), text)
    assert text_of(events) == "" and [c[0] for c in calls(events)] == ["a", "b"]
    events = check_every_split(tools_of("hermes"), 'x <tool_call>{"name": "a", "arguments": {}}</tool_call> y')
    assert text_of(events) == "x  y"


def test_think_reasoning_apart_and_calls_only_from_the_answer():
    call = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    # Qwen3 hybrid: the model opens the block itself; a call inside the reasoning is reasoning
    events = check_every_split(tools_of("hermes", "qwen3"), f"<think>\nmaybe {call}?\n</think>\n\nDone. {call}")
    assert text_of(events, "reasoning") == f"\nmaybe {call}?\n" and text_of(events) == "Done. "
    assert [c[0] for c in calls(events)] == ["a"]
    # DeepSeek-R1 / thinking templates: the prompt opened it
    assert opened_in_prompt("<｜Assistant｜><think>\n") and not opened_in_prompt("<think>\n\n</think>\n\n")
    events = check_every_split(tools_of("deepseek_v3", "deepseek_r1", open_=True), "hmm, 2 + 2</think>4")
    assert text_of(events, "reasoning") == "hmm, 2 + 2" and text_of(events) == "4"
    # never closed (max_tokens): all reasoning; no block: all answer
    events = check_every_split(tools_of("hermes", "qwen3", open_=True), "still thinking <")
    assert text_of(events, "reasoning") == "still thinking <" and text_of(events) == ""
    assert text_of(check_every_split(tools_of("hermes", "qwen3"), "  <thin but no tag")) == "  <thin but no tag"


def test_harmony_channels_without_tools():
    text = "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer <b>."
    make = lambda: output("harmony", "harmony", tools=False, reasoning_open=False)  # noqa: E731
    events = check_every_split(make, text)
    assert events == [("reasoning", "Think."), ("content", "Answer <b>.")]
    call = "<|channel|>commentary to=functions.f<|message|>{}<|call|>"
    assert calls(check_every_split(make, call)) == []  # no tools in the request: a call is content


def test_forced_tool_choice_replies():
    events = check_every_split(lambda: Output(None, Named("get_weather")), WEATHER)
    assert calls(events) == [("get_weather", {"city": "Paris", "days": 3})]
    text = '[{"name": "a", "parameters": {"x": "}]"}}, {"name": "b", "parameters": {}}]'
    events = check_every_split(lambda: Output(None, Required()), text)
    assert calls(events) == [("a", {"x": "}]"}), ("b", {})]
    events = check_every_split(lambda: Output(None, Required()), '[{"name": "a", "parameters": {}}, {"name": "b", "par')
    assert calls(events) == [("a", {})]  # cut short: its complete calls
    assert text_of(check_every_split(lambda: Output(None, Required()), "nope")) == "nope"


def test_parsers_are_chosen_from_the_template_then_the_model_type():
    assert choose("qwen3_moe", "{{ '<tool_call>' }}{{ '<think>' }}") == ("hermes", "qwen3")
    assert choose("qwen3_moe", "{{ '<tool_call>' }}") == ("hermes", None)
    assert choose(None, "<｜tool▁calls▁begin｜> <think>") == ("deepseek_v3", "deepseek_r1")
    assert choose("gpt_oss", None) == ("harmony", "harmony")
    assert choose("llama", "<|channel|>") == ("harmony", "harmony")
    assert choose("mixtral", "[INST]") == ("mistral", None)
    assert choose("gemma4", "<|tool_call>") == ("gemma4", None)
    assert choose("llama", "plain") == (None, None)
