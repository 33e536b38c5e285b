"""Tool calls and reasoning through a live `moemesh serve` of the tiny random model, driven by real
clients: the `openai` client (chat.completions.create with tools, streamed and not,
chat.completions.stream(), chat.completions.parse with a strict pydantic_function_tool), the
`openai-agents` SDK (an Agent whose @function_tool runs, over OpenAIChatCompletionsModel) and
`langchain-openai`'s bind_tools.

What this proves, honestly: a random model never writes a tool call by itself, so every call here
is forced by the grammar (tool_choice named or required, llguidance) — the path from the request's
tools to the schema, the constrained tokens, their reading into OpenAI's tool_calls, streamed and
whole, and each client's own handling of them. The families' own formats (Hermes, DeepSeek,
Mistral, Gemma-4, harmony) are read in tests/test_inference_tool_parsers.py from fixed outputs.
Reasoning: the template opens a thinking block when asked (chat_template_kwargs), so the random
reply is all reasoning — reasoning_content, streamed and whole, apart from the content.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Literal

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests use the openai client")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")
pytest.importorskip("llguidance", reason="forced tool calls need llguidance (pip install moemesh[serve])")

from serving import TOOLS_TEMPLATE as TEMPLATE  # noqa: E402
from serving import forced_weather_agent, openai_client, serve_with_template, write_checkpoint  # noqa: E402

CITY = {"type": "string", "enum": ["Paris", "Rome"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_with_template(write_checkpoint(tmp_path_factory.mktemp("tools")), TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    """A stream's tool calls put together as a client does, its finish_reason and its content;
    each call's first delta must carry index, id, type and the whole name."""
    calls, reason, content = {}, None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and not delta.function.name
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], reason, content


def test_named_and_required_tool_choice_streamed_and_whole(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    settings = dict(model="tiny", messages=USER, tools=[WEATHER, NOW], max_completion_tokens=40, temperature=1.0)
    for seed in range(2):
        reply = client.chat.completions.create(**settings, tool_choice=named, seed=seed)
        choice = reply.choices[0]
        (call,) = choice.message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert choice.finish_reason == "tool_calls" and call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
        assert 1 <= arguments["days"] <= 7 and choice.message.content is None
        calls, reason, content = _streamed_calls(
            client.chat.completions.create(**settings, tool_choice=named, seed=seed, stream=True)
        )
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    # required: vLLM's list of {name, parameters}; parallel_tool_calls false: one call
    reply = client.chat.completions.create(
        **settings, tool_choice="required", parallel_tool_calls=False, seed=3, max_tokens=None
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "now") and isinstance(json.loads(call.function.arguments), dict)
    streamed, reason, _ = _streamed_calls(
        client.chat.completions.create(
            **settings, tool_choice="required", parallel_tool_calls=False, seed=3, stream=True
        )
    )
    assert reason == "tool_calls" and [(c["name"], c["arguments"]) for c in streamed] == [
        (call.function.name, call.function.arguments)
    ]


def test_auto_and_none_give_content_never_an_error(client):
    """The random model writes no call: with tool_choice auto (what agents send on every request)
    or none its reply is content, finish_reason stop or length."""
    for choice in ("auto", "none", None):
        extra = {} if choice is None else {"tool_choice": choice}
        reply = client.chat.completions.create(
            model="tiny", messages=USER, tools=[WEATHER], max_completion_tokens=8, temperature=0, **extra
        )
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "length"


def test_the_openai_stream_helper_and_parse_with_a_strict_pydantic_tool(client):
    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: Literal["Paris", "Rome"]
        metric: bool

    tool = openai.pydantic_function_tool(GetWeather)
    assert tool["function"]["strict"] is True
    named = {"type": "function", "function": {"name": "GetWeather"}}
    reply = client.chat.completions.parse(
        model="tiny", messages=USER, tools=[tool], tool_choice=named, max_completion_tokens=80, seed=1
    )
    parsed = reply.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and parsed.city in ("Paris", "Rome")
    with client.chat.completions.stream(
        model="tiny", messages=USER, tools=[tool], tool_choice=named, max_completion_tokens=80, seed=1
    ) as stream:
        done = [event for event in stream if event.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and done[0].name == "GetWeather" and isinstance(done[0].parsed_arguments, GetWeather)
    assert (
        final.choices[0].message.tool_calls[0].function.arguments
        == reply.choices[0].message.tool_calls[0].function.arguments
    )


def test_a_conversation_that_carries_calls(server, client):
    """An assistant message with tool_calls (arguments a JSON string) and the tool's answer are
    accepted and rendered, the arguments given to the template as the object."""
    from moemesh.inference.front import Front
    from moemesh.inference.protocol import ApiError, chat_plan

    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    reply = client.chat.completions.create(  # greedy: a sampled first token could end the turn at once
        model="tiny", messages=messages, tools=[WEATHER], max_tokens=3, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
    served = Front(server.service.settings, link=None).served
    prompt = served.tokenizer.decode(chat_plan({"messages": messages, "tools": [WEATHER]}, served).prompts[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in prompt
    assert (
        "<tool_response>\nsunny\n</tool_response>" in prompt and '"name": "get_weather"' in prompt.split("</tools>")[0]
    )
    bad_arguments = [{**messages[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]
    for body, param, message in [
        ({"messages": USER + bad_arguments}, "messages", "arguments is not JSON"),
        ({"messages": USER, "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"messages": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not one of the tools",
        ),
        ({"messages": USER, "reasoning_effort": "high"}, "reasoning_effort", "has no reasoning effort"),
        ({"messages": USER, "functions": [{}]}, "functions", "send tools"),
    ]:
        with pytest.raises(ApiError, match=message) as error:
            chat_plan(body, served)
        assert error.value.status == 400 and error.value.param == param


def test_reasoning_apart_from_the_content_streamed_and_whole(client):
    settings = dict(model="tiny", messages=USER, max_completion_tokens=12, temperature=0)
    thinking = client.chat.completions.create(
        **settings, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    message = thinking.choices[0].message.model_dump()
    assert (
        message["content"] == ""
        and message["reasoning_content"]
        and message["reasoning"] == message["reasoning_content"]
    )
    streamed = client.chat.completions.create(
        **settings, stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    deltas = [chunk.choices[0].delta.model_dump() for chunk in streamed if chunk.choices]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    plain = client.chat.completions.create(**settings).choices[0].message.model_dump()
    assert plain["content"] and plain["reasoning_content"] is None


def test_reasoning_effort_reaches_a_template_that_reads_it(server):
    from moemesh.inference.chat import ChatTemplate
    from moemesh.inference.front import Front
    from moemesh.inference.protocol import chat_plan

    served = Front(server.service.settings, link=None).served
    template = ChatTemplate("Reasoning: {{ reasoning_effort or 'medium' }}\n{{ messages[0]['content'] }}")
    plan = chat_plan({"messages": USER, "reasoning_effort": "high"}, replace(served, chat_template=template))
    assert served.tokenizer.decode(plan.prompts[0]) == "Reasoning: high\nweather?"


def test_agents_sdk_runs_a_function_tool(server):
    pytest.importorskip("agents", reason="openai-agents is in the test extra")
    ran, final_output = forced_weather_agent(server.url, "OpenAIChatCompletionsModel")
    assert len(ran) == 1 and final_output == f"sunny in {ran[0]}"


def test_langchain_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
    chat = langchain_openai.ChatOpenAI(
        model="tiny", base_url=server.url + "/v1", api_key="none", max_retries=0, max_tokens=40, temperature=1.0
    )
    message = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("weather?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Rome") and call["id"]


def test_no_500_for_any_forced_reply(server):
    """A forced call cut by max_tokens is returned as cut (as OpenAI's JSON is), never a 500."""
    body = {"model": "tiny", "messages": USER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 3}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"
