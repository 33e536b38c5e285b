"""`/v1/responses` (OpenAI's Responses API, stateless) through a live `moemesh serve` of the tiny
random model, driven by real clients: the `openai` client's responses.create and
responses.stream(), and the `openai-agents` SDK's OpenAIResponsesModel running a function tool.

As in tests/test_inference_tool_calls.py, the random model never calls a tool by itself: every
function_call here is forced by the grammar (tool_choice named or required). Its special tokens
never come, so a text reply ends by max_output_tokens (status incomplete); a JSON reply under
text.format and a forced call end when their JSON does (status completed). Reasoning: the
template opens a thinking block when the request gives a reasoning effort, so that reply is all
reasoning.
"""

from __future__ import annotations

import json

import httpx
import pytest

openai = pytest.importorskip("openai", reason="the server tests use the openai client")
pytest.importorskip("fastapi", reason="moemesh serve needs fastapi and uvicorn (pip install moemesh[serve])")
pytest.importorskip("llguidance", reason="forced tool calls need llguidance (pip install moemesh[serve])")

from serving import TOOLS_TEMPLATE, forced_weather_agent, openai_client, serve_with_template, write_checkpoint  # noqa: E402

TEMPLATE = TOOLS_TEMPLATE.replace("{% if enable_thinking %}", "{% if enable_thinking or reasoning_effort %}")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Rome"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "strict": True,
}
NOW = {
    "type": "function",
    "name": "now",
    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve_with_template(write_checkpoint(tmp_path_factory.mktemp("responses")), TEMPLATE)


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server.url)


def _raw_events(server, body: dict) -> list[dict]:
    """A stream's events as sent: each an `event:` line and a `data:` JSON of that type."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in reply.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: ") :])
                assert event["type"] == kind
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _anonymous(response: dict) -> dict:
    """A response without what differs between two runs of the same request (ids, times), nor
    what the SDK's stream helper adds (`parsed`)."""
    response = json.loads(json.dumps(response))
    for key in ("id", "created_at"):
        response.pop(key)
    for item in response["output"]:
        item.pop("id")
        item.pop("call_id", None)
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return response


def test_text_whole_and_streamed(server, client):
    settings = dict(model="tiny", input="hello", instructions="be brief", max_output_tokens=8, temperature=0)
    settings |= dict(metadata={"k": "v"}, user="u1")
    response = client.responses.create(**settings)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens" and response.model == "tiny"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.status == "incomplete" and message.content[0].type == "output_text"
    assert message.content[0].annotations == [] and response.output_text == message.content[0].text
    usage = response.usage
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.input_tokens_details.cached_tokens == 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert response.metadata == {"k": "v"} and response.user == "u1" and response.instructions == "be brief"
    assert response.tools == [] and response.tool_choice == "auto" and response.temperature == 0
    assert response.store is False and response.parallel_tool_calls is True

    events = _raw_events(server, settings)
    kinds = [e["type"] for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:] == [*tail, "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == message.content[0].text == events[-4]["text"]
    assert _anonymous(events[-1]["response"]) == _anonymous(response.model_dump(exclude_unset=True, mode="json"))

    # the SDK's stream helper reads the same events (it reports the final response only when completed)
    with client.responses.stream(**settings) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
    assert "".join(deltas) == text


def test_json_schema_format_completes_whole_and_streamed(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    settings = dict(model="tiny", input="a city", text=fmt, max_output_tokens=60, temperature=0)
    response = client.responses.create(**settings)
    assert response.status == "completed" and response.incomplete_details is None
    value = json.loads(response.output_text)
    assert value["city"] in ("Paris", "Rome") and isinstance(value["n"], int)
    assert response.text.format.type == "json_schema" and response.text.format.name == "answer"
    with client.responses.stream(**settings) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert _anonymous(final.model_dump(mode="json")) == _anonymous(response.model_dump(mode="json"))
    any_object = client.responses.create(**{**settings, "text": {"format": {"type": "json_object"}}})
    assert isinstance(json.loads(any_object.output_text), dict)


def test_forced_function_calls_whole_and_streamed(server, client):
    settings = dict(model="tiny", input="weather?", tools=[WEATHER, NOW], max_output_tokens=40, temperature=0)
    named = {"type": "function", "name": "get_weather"}
    response = client.responses.create(**settings, tool_choice=named)
    assert response.status == "completed" and response.tool_choice.name == "get_weather"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
    assert [tool.name for tool in response.tools] == ["get_weather", "now"] and response.tools[0].strict is True

    events = _raw_events(server, {**settings, "tool_choice": named})
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert events[2]["item"]["name"] == "get_weather" and events[2]["item"]["arguments"] == ""
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert streamed == events[-3]["arguments"] == call.arguments

    with client.responses.stream(**settings, tool_choice=named) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert _anonymous(final.model_dump(mode="json")) == _anonymous(response.model_dump(mode="json"))

    # required, one call: vLLM's list form, read into function_call items
    required = client.responses.create(**settings, tool_choice="required", parallel_tool_calls=False)
    (call,) = required.output
    assert call.type == "function_call" and call.name in ("get_weather", "now")
    assert isinstance(json.loads(call.arguments), dict) and required.parallel_tool_calls is False


def test_a_conversation_with_calls_and_their_outputs(server, client):
    from moemesh.inference.front import Front
    from moemesh.inference.responses_api import responses_plan

    conversation = [
        {"role": "developer", "content": "use tools"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Rome", "days": 1}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}],
        },
        {"role": "user", "content": "thanks"},
    ]
    served = Front(server.service.settings, link=None).served
    planned = responses_plan({"input": conversation, "tools": [WEATHER], "instructions": "be kind"}, served)
    prompt = served.tokenizer.decode(planned.plan.prompts[0], skip_special_tokens=False)
    assert prompt.index("<|im_start|>system\nbe kind") < prompt.index("<|im_start|>developer\nuse tools")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt and "It is sunny.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>user\nthanks<|im_end|>\n<|im_start|>assistant\n")
    response = client.responses.create(
        model="tiny", input=conversation, tools=[WEATHER], instructions="be kind", max_output_tokens=3
    )
    assert response.status == "incomplete" and response.usage.input_tokens == len(planned.plan.prompts[0])


def test_reasoning_items_whole_and_streamed(server, client):
    settings = dict(model="tiny", input="think", reasoning={"effort": "high"}, max_output_tokens=10, temperature=0)
    response = client.responses.create(**settings)
    (reasoning,) = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 10 and response.reasoning.effort == "high"
    events = _raw_events(server, settings)
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert kinds[-4:] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == reasoning.content[0].text
    assert _anonymous(events[-1]["response"]) == _anonymous(response.model_dump(exclude_unset=True, mode="json"))


def test_what_is_refused_names_its_field(server):
    def post(**body):
        return httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "hi", **body}, timeout=60)

    # what Codex sends (stateless: store false, reasoning carried by the client)
    codex = dict(store=False, include=["reasoning.encrypted_content"], prompt_cache_key="k", stream_options=None)
    ok = post(**codex, reasoning={"effort": "low", "summary": "auto"}, max_output_tokens=2, tools=[NOW])
    assert ok.status_code == 200 and ok.json()["output"][0]["type"] == "reasoning", ok.text
    for body, param, message in [
        ({"store": True}, "store", "nothing is stored"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "nothing is stored"),
        ({"conversation": "conv_1"}, "conversation", "nothing is stored"),
        ({"background": True}, "background", "foreground"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "must have a name"),
        ({"include": ["file_search_call.results"]}, "include", "cannot be included"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "nothing is stored"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "text"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "must be"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text", "name"),
        ({"reasoning": {"effort": "huge"}}, "reasoning", "effort"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "exceed the context"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be an integer >= 1"),
        ({"tools": [NOW, NOW]}, "tools", "two tools are named 'now'"),
        ({"tools": [NOW], "tool_choice": {"type": "function", "name": "x"}}, "tool_choice", "not one of the tools"),
        ({"input": None}, "input", "input must be"),
        ({"max_tokens": 5}, "max_tokens", "unknown field"),
        ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ]:
        reply = post(**body)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert error["param"] == param and message in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"


def test_agents_sdk_runs_a_function_tool_over_responses(server):
    pytest.importorskip("agents", reason="openai-agents is in the test extra")
    ran, final_output = forced_weather_agent(server.url, "OpenAIResponsesModel")
    assert len(ran) == 1 and final_output == f"sunny in {ran[0]}"
