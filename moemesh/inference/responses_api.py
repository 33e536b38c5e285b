"""OpenAI's Responses API (`POST /v1/responses`), stateless: the request read and checked
(every field works as OpenAI documents it or is a 400 naming it, in the Responses API's names),
then run as a chat completion — the same template rendering, tools, forced tool_choice through
the grammar and output parsers (protocol.py's chat_plan, responses.py's Parsed) — and answered
as a response object: output items (reasoning, message, function_call) and, streamed, OpenAI's
semantic events, each with its `sequence_number`.

Stateless: nothing is stored, so `store: true`, `previous_response_id`, `conversation`,
`background: true` and `input` item references are refused; a conversation is carried by its
client in `input` (messages, `function_call` and `function_call_output` items). An absent
`store` is accepted although OpenAI's default is true: the openai SDK and openai-agents send no
`store` unless it is set, and refusing them would refuse every plain request; what such a client
gets is what `store: false` gives (Codex sends that).

How the request becomes a chat request: `instructions` is a system message first; `input` a
string (one user message) or items: messages (roles user, system, developer, assistant; content
a string or input_text / output_text parts), `function_call` items (with the assistant message
before them, one assistant message with its tool_calls), `function_call_output` items (tool
messages), `reasoning` items dropped (as chat templates drop past thinking). Function tools are
Responses' flat `{type, name, description, parameters, strict}`; `tool_choice` `none` / `auto` /
`required` / `{type: function, name}`; `text.format` is `response_format`; `reasoning.effort`
is `reasoning_effort` (for templates that read it). An error the chat path raises is renamed to
the Responses field it came from (`messages` -> `input`, `max_completion_tokens` ->
`max_output_tokens`, `response_format` -> `text`, `reasoning_effort` -> `reasoning`).

The output is built by one machine for both answers (`Items`): fed the parsed events of the
text as it becomes final, it opens an item when the kind of text changes (reasoning, content, a
call) and closes the one before; so a streamed response's items are the non-streamed one's.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from moemesh.data.tokenizer import Tokenizer
from moemesh.inference.protocol import ApiError, Plan, Served, chat_plan
from moemesh.inference.request import Sequence, check_text, short
from moemesh.inference.responses import Parsed

FIELDS = {
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "temperature",
    "top_p",
    "text",
    "reasoning",
    "metadata",
    "user",
    "stream",
    "stream_options",
    "include",
    # accepted as identifiers, used for nothing (as `user`): they change no token
    "safety_identifier",
    "prompt_cache_key",
    # accepted at the value that asks for nothing (checked below)
    "store",
    "background",
    "service_tier",
    "truncation",
}
# Refused unless null: field -> why.
REFUSED = {
    "previous_response_id": "previous_response_id: nothing is stored on this server (send the conversation in input)",
    "conversation": "conversation: nothing is stored on this server (send the conversation in input)",
    "prompt": "prompt (a stored prompt template) is not supported: nothing is stored on this server",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
    "context_management": "context_management (compaction) is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported (nothing is retained)",
    "prompt_cache_options": "prompt_cache_options is not supported",
}
# include values honoured: reasoning items carry their text in content and nothing encrypted
# (nothing needs carrying back: reasoning items in input are dropped)
INCLUDE = ("reasoning.encrypted_content",)
CHAT_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


@dataclass
class ResponsesPlan:
    """A chat Plan, and what the response object echoes of the request."""

    plan: Plan
    echo: dict


def responses_plan(body: dict, served: Served) -> ResponsesPlan:
    for name in body:
        if name in REFUSED and body[name] is not None:
            raise ApiError(400, REFUSED[name], name)
        if name not in FIELDS and name not in REFUSED:
            raise ApiError(400, f"unknown field {short(name)}", name[:100])
    get = _Getter(body)
    if get("store", bool, "true or false"):
        raise ApiError(400, "store: nothing is stored on this server (store must be false)", "store")
    if get("background", bool, "true or false"):
        raise ApiError(400, "background: responses run in the foreground only (background must be false)", "background")
    if get("service_tier", str, "a string") not in (None, "auto", "default"):
        raise ApiError(400, "service_tier: this server has one tier (auto or default)", "service_tier")
    if get("truncation", str, "a string") not in (None, "disabled"):
        raise ApiError(400, "truncation: only disabled (an input over the context is a 400)", "truncation")
    for value in get("include", list, "a list") or []:
        if value not in INCLUDE:
            raise ApiError(400, f"include: {short(value)} cannot be included by this server", "include")
    options = get("stream_options", dict, "an object") or {}
    if set(options) - {"include_obfuscation"}:
        raise ApiError(400, f"stream_options has an unknown field {short(sorted(set(options))[0])}", "stream_options")
    stream = bool(get("stream", bool, "true or false"))
    metadata = _metadata(get("metadata", dict, "an object"))
    instructions = get("instructions", str, "a string")
    messages = [{"role": "system", "content": instructions}] if instructions is not None else []
    messages += _input(body.get("input"))
    if not messages:
        raise ApiError(400, "input must be a string or a non-empty list of items", "input")
    tools = _tools(get("tools", list, "a list of tools") or [])
    choice = _tool_choice(body.get("tool_choice"))
    text = _text_config(get("text", dict, "an object"))
    effort, summary = _reasoning(get("reasoning", dict, "an object"))
    chat: dict[str, Any] = {"messages": messages}
    if tools:
        chat["tools"] = [{"type": "function", "function": tool} for tool in tools]
    if choice is not None and (tools or choice not in ("auto", "none")):
        chat["tool_choice"] = (
            {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
        )
    for name, chat_name in (
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
        ("safety_identifier", "safety_identifier"),
        ("prompt_cache_key", "prompt_cache_key"),
    ):
        if body.get(name) is not None:
            chat[chat_name] = body[name]
    if text is not None:
        chat["response_format"] = _response_format(text)
    if effort is not None:
        chat["reasoning_effort"] = effort
    try:
        plan = chat_plan(chat, served)
    except ApiError as e:
        message = e.message
        for chat_name, name in (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format")):
            message = message.replace(chat_name, name)
        message = message.replace("reasoning_effort", "reasoning.effort").replace("].function.", "].")
        raise ApiError(e.status, message, CHAT_NAMES.get(e.param, e.param), e.code, e.kind) from None
    plan = replace(plan, stream=stream, include_usage=False)
    parallel = body.get("parallel_tool_calls")
    echo = {
        "instructions": instructions,
        "metadata": metadata,
        "parallel_tool_calls": True if parallel is None else parallel,
        "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
        "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
        "tool_choice": choice if choice is not None else "auto",
        "tools": [{"type": "function", **tool} for tool in tools],
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "reasoning": {"effort": effort, "summary": summary},
        "store": False,
        "background": False,
        "service_tier": "default",
        "text": {"format": text or {"type": "text"}},
        "truncation": "disabled",
        "user": body.get("user"),
    }
    return ResponsesPlan(plan, echo)


class _Getter:
    """A field's value with its type checked; null reads as absent (None)."""

    def __init__(self, body: dict):
        self.body = body

    def __call__(self, name: str, kind: type, what: str):
        value = self.body.get(name)
        if value is not None and (not isinstance(value, kind) or (kind is not bool and isinstance(value, bool))):
            raise ApiError(400, f"{name} must be {what}", name)
        if isinstance(value, str):
            _check(value, name, name)
        return value


def _check(text: str, where: str, param: str) -> None:
    try:
        check_text(text, where)
    except Exception as e:  # RequestError: a lone surrogate
        raise ApiError(400, str(e), param) from None


def _metadata(metadata: dict | None) -> dict | None:
    """OpenAI's limits: up to 16 pairs, keys up to 64 characters, values strings up to 512."""
    if metadata is None:
        return None
    if len(metadata) > 16:
        raise ApiError(400, "metadata has more than 16 keys", "metadata")
    for key, value in metadata.items():
        if len(key) > 64 or not isinstance(value, str) or len(value) > 512:
            raise ApiError(
                400,
                f"metadata: {short(key)} must be a key of up to 64 characters with a string of up to 512",
                "metadata",
            )
        _check(key, "metadata", "metadata")
        _check(value, "metadata", "metadata")
    return metadata


# ---- input -------------------------------------------------------------------------------------


def _input(items) -> list[dict]:
    """`input` as chat messages (module docstring)."""
    if isinstance(items, str):
        _check(items, "input", "input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(400, "input must be a string or a list of items", "input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(400, f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in MESSAGE_ROLES:
                roles = ", ".join(MESSAGE_ROLES)
                raise ApiError(400, f"{where}.role must be one of {roles}, got {short(role)}", "input")
            messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call_id, name, arguments = (_string(item, key, where) for key in ("call_id", "name", "arguments"))
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            output = item.get("output")
            output = output if isinstance(output, str) else _content(output, f"{where}.output")
            _check(output, f"{where}.output", "input")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # past thinking: templates drop it
        elif kind == "item_reference":
            raise ApiError(400, f"{where}: item references need stored items, and nothing is stored here", "input")
        else:
            raise ApiError(
                400,
                f"{where}: only message, function_call, function_call_output and reasoning items are supported, "
                f"got type {short(kind)}",
                "input",
            )
    return messages


def _content(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        _check(content, where, "input")
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
            continue
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(
                400, f"{where}[{j}]: only text parts are supported (a text model), got {short(kind)}", "input"
            )
        texts.append(part["text"])
    text = "".join(texts)
    _check(text, where, "input")
    return text


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", "input")
    _check(value, f"{where}.{key}", "input")
    return value


# ---- tools, tool_choice, text, reasoning -------------------------------------------------------

TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _tools(tools: list) -> list[dict]:
    """Responses' function tools, flat: [{type: function, name, description?, parameters?,
    strict?}] -> chat's function objects (protocol.py checks the rest: names unique, types)."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"{where}: only function tools are supported, got type {short(kind)}", "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(400, f"{where} must have a name", "tools")
        unknown = sorted(set(tool) - TOOL_KEYS)
        if unknown:
            raise ApiError(400, f"{where} has an unknown field {short(unknown[0])}", "tools")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        out.append(function)
    return out


def _tool_choice(choice):
    """none | auto | required | {"type": "function", "name": NAME} (None: not given)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if set(choice) - {"type", "name"}:
            raise ApiError(
                400,
                f"tool_choice has an unknown field {short(sorted(set(choice) - {'type', 'name'})[0])}",
                "tool_choice",
            )
        return {"type": "function", "name": choice["name"]}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise ApiError(
        400,
        f'tool_choice must be none, auto, required or {{"type": "function", "name": ...}}, got {short(kind)}',
        "tool_choice",
    )


def _text_config(text: dict | None) -> dict | None:
    """text.format, checked: {type: text} | {type: json_object} | {type: json_schema, name,
    schema, description?, strict?} (None: not given)."""
    if text is None:
        return None
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise ApiError(400, f"text has an unknown field {short(unknown[0])}", "text")
    if text.get("verbosity") is not None:
        raise ApiError(400, "text.verbosity is not supported", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        if set(fmt) != {"type"}:
            raise ApiError(400, f"text.format of type {kind} has no other field", "text")
        return {"type": kind}
    if kind != "json_schema":
        raise ApiError(400, f"text.format.type must be text, json_object or json_schema, got {short(kind)}", "text")
    unknown = sorted(set(fmt) - {"type", "name", "schema", "description", "strict"})
    if unknown:
        raise ApiError(400, f"text.format has an unknown field {short(unknown[0])}", "text")
    if not isinstance(fmt.get("name"), str) or not fmt["name"]:
        raise ApiError(400, "text.format.name must be a non-empty string", "text")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "text.format.schema must be a JSON schema (an object)", "text")
    return dict(fmt)


def _response_format(fmt: dict) -> dict:
    if fmt["type"] != "json_schema":
        return fmt
    return {"type": "json_schema", "json_schema": {key: value for key, value in fmt.items() if key != "type"}}


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = ("auto", "concise", "detailed")


def _reasoning(reasoning: dict | None) -> tuple[str | None, str | None]:
    """(effort, summary). A summary is accepted and none is written (summary stays [])."""
    if reasoning is None:
        return None, None
    unknown = sorted(set(reasoning) - {"effort", "summary", "generate_summary"})
    if unknown:
        raise ApiError(400, f"reasoning has an unknown field {short(unknown[0])}", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise ApiError(400, f"reasoning.effort must be one of {', '.join(EFFORTS)}, got {short(effort)}", "reasoning")
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in SUMMARIES:
        raise ApiError(
            400, f"reasoning.summary must be one of {', '.join(SUMMARIES)}, got {short(summary)}", "reasoning"
        )
    return effort, summary


# ---- the response --------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


class Items:
    """The output items of one reply, built from its parsed events (a piece of text at a time)
    with the stream's events as they happen: an item opens when the kind of text changes and the
    item before it closes; `finish` closes the last, `incomplete` when the reply was cut."""

    def __init__(self):
        self.output: list[dict] = []
        self.events: list[dict] = []  # the stream's, without sequence numbers
        self.kind: str | None = None  # of the open item: reasoning | content | call
        self.text = ""  # the open item's text (or arguments)

    def add(self, events: list[tuple[str, str]]) -> None:
        for kind, value in events:
            if kind == "call":
                self._close("completed")
                self._open_call(value)
            elif kind == "arguments":
                if self.kind != "call":  # no call open: nothing to add to (a parser never does this)
                    continue
                self.text += value
                self._event("response.function_call_arguments.delta", delta=value, item_id=self.item["id"])
            else:
                if value and kind != self.kind:
                    self._close("completed")
                    self._open_text(kind)
                if value:
                    self.text += value
                    delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
                    extra = {} if kind == "reasoning" else {"logprobs": []}
                    self._event(delta, item_id=self.item["id"], content_index=0, delta=value, **extra)

    @property
    def item(self) -> dict:
        return self.output[-1]

    def _event(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "output_index": len(self.output) - 1, **fields})

    def _open_text(self, kind: str) -> None:
        self.kind, self.text = kind, ""
        if kind == "reasoning":
            item = {"id": _id("rs_"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg_"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        self.output.append(item)
        self._event("response.output_item.added", item=json.loads(json.dumps(item)))
        self._event("response.content_part.added", item_id=item["id"], content_index=0, part=part)

    def _open_call(self, name: str) -> None:
        self.kind, self.text = "call", ""
        item = {
            "id": _id("fc_"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": "call_" + uuid.uuid4().hex[:24],
            "name": name,
            "arguments": "",
        }
        self.output.append(item)
        self._event("response.output_item.added", item=dict(item))

    def _close(self, status: str) -> None:
        if self.kind is None:
            return
        item, text = self.item, self.text
        if self.kind == "call":
            item.update(arguments=text, status=status)
            self._event("response.function_call_arguments.done", item_id=item["id"], arguments=text)
        elif self.kind == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            self._event("response.reasoning_text.done", item_id=item["id"], content_index=0, text=text)
            self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)
        else:
            part = {"type": "output_text", "text": text, "annotations": []}
            item.update(content=[part], status=status)
            self._event("response.output_text.done", item_id=item["id"], content_index=0, text=text, logprobs=[])
            self._event("response.content_part.done", item_id=item["id"], content_index=0, part=part)
        self._event("response.output_item.done", item=json.loads(json.dumps(item)))
        self.kind, self.text = None, ""

    def finish(self, incomplete: bool) -> None:
        self._close("incomplete" if incomplete else "completed")

    def reasoning_text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "reasoning" for part in item["content"])


class ResponseReply:
    """The response object of a Responses plan's one sequence, whole or as a stream's events.
    The interface front.py's respond and stream read (Reply's): usage(), whole(), first_events(),
    event(), error_event(), last_events()."""

    def __init__(self, model: str, planned: ResponsesPlan, sequences: list[Sequence], tokenizer: Tokenizer):
        self.model, self.plan, self.echo, self.tokenizer = model, planned.plan, planned.echo, tokenizer
        self.sequences = sequences
        self.id = _id("resp_")
        self.created = int(time.time())
        self.items = Items()
        self.parsed = Parsed(self.plan.output(), self.plan.one_call) if self.plan.output is not None else None
        self.sequence_number = 0

    def usage(self) -> dict[str, int]:
        """In chat's names (the access log reads them)."""
        prompt, completion = len(self.plan.prompts[0]), len(self.sequences[0].token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _feed(self, text: str, reason: str | None) -> None:
        final = reason is not None
        if self.parsed is not None:
            events = self.parsed.events(text, final)
        else:
            events = [("content", text)] if text else []
        self.items.add(events)
        if final:
            self.items.finish(incomplete=reason == "length")

    def response(self, status: str) -> dict:
        """The response object; its output and usage once the reply has ended."""
        sequence = self.sequences[0]
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model,
            "output": self.items.output if status != "in_progress" else [],
            **self.echo,
            "usage": None,
        }
        if status != "in_progress":
            usage = self.usage()
            reasoning = self.items.reasoning_text()
            body["usage"] = {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                # the reasoning text re-encoded: what was generated may split into a token or two more or fewer
                "output_tokens_details": {
                    "reasoning_tokens": min(len(self.tokenizer.encode(reasoning)), len(sequence.token_ids))
                    if reasoning
                    else 0
                },
                "total_tokens": usage["total_tokens"],
            }
        return body

    def _status(self) -> str:
        return "incomplete" if self.sequences[0].finish_reason == "length" else "completed"

    # ---- whole ---------------------------------------------------------------------------------
    def whole(self) -> dict:
        sequence = self.sequences[0]
        self._feed(sequence.text, sequence.finish_reason)
        return self.response(self._status())

    # ---- streamed ------------------------------------------------------------------------------
    def _sse(self, event: dict) -> str:
        event = {"type": event["type"], "sequence_number": self.sequence_number, **event}
        self.sequence_number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    def first_events(self) -> list[str]:
        created = self.response("in_progress")
        return [
            self._sse({"type": "response.created", "response": created}),
            self._sse({"type": "response.in_progress", "response": created}),
        ]

    def event(self, index: int, text: str, reason: str | None, tokens: tuple[int, int], first: bool) -> str:
        start = len(self.items.events)
        self._feed(text, reason)
        out = "".join(self._sse(event) for event in self.items.events[start:])
        if reason is not None:
            status = self._status()
            out += self._sse({"type": f"response.{status}", "response": self.response(status)})
        return out

    def error_event(self, error: ApiError) -> str:
        return self._sse({"type": "error", "code": error.code, "message": error.message, "param": error.param})

    def last_events(self, include_usage: bool) -> list[str]:
        return []  # the Responses API's stream ends at its response.completed (no [DONE])
