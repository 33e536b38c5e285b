"""OpenAI's completions and chat-completions requests, read and checked before anything runs:
every field either works as OpenAI documents it or is refused with a 400 that names it — none is
silently ignored (docs/openai_api.md has the table). The HTTP side is front.py; the response
objects are responses.py; the scheduler never sees a JSON body.

A request becomes a `Plan`: its prompts (token ids, with the text to echo), and for each prompt
`best_of` sequences (n when best_of is not given), each with its own SamplingParams — the same
settings and its own seed, derived from the request's (choice 0 takes the request's seed itself,
so n = 1 is what it always was). A field whose value is null is as if it were absent. Fields
beyond OpenAI's are vLLM's spelling of the same thing (stop_token_ids, repetition_penalty,
chat_template_kwargs).

Tools: a chat request's function `tools` are given to the template; its replies are read by the
served model's parsers (parsers/registry.py: the family's tool-call format, its reasoning) into
the Plan's `output`. `tool_choice` required or named forces the call through the grammar, in
vLLM's forms (parsers/forced.py). Assistant messages' `tool_calls` reach the template with their
arguments as objects.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import RequestError
from moemesh.inference.chat import ChatTemplate
from moemesh.inference.grammar import Grammars
from moemesh.inference.grammar import available as grammar_available
from moemesh.inference.parsers.forced import Named, Required
from moemesh.inference.parsers.registry import Output, output
from moemesh.inference.parsers.think import opened_in_prompt
from moemesh.inference.request import (
    MAX_LOGPROBS,
    SEED_MODULUS,
    SamplingParams,
    check_request,
    check_text,
    prompt_ids,
    short,
)


class ApiError(Exception):
    """OpenAI's error object {"error": {"message", "type", "param", "code"}} with its HTTP status
    (429 and 503 say when to retry)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": "1"} if self.status in (429, 503) else {}


def bad(error: RequestError) -> ApiError:
    return ApiError(400, str(error), error.param)


# ---- the fields --------------------------------------------------------------------------------

SHARED = {
    "model",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
}
COMPLETION_FIELDS = SHARED | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = SHARED | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    # accepted as identifiers, used for nothing (as `user`): they change no token
    "safety_identifier",
    "prompt_cache_key",
    # accepted at the value that asks for nothing (checked below)
    "store",
    "service_tier",
    "modalities",
    # tool calling and reasoning (the model family's parsers: inference/parsers/)
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "reasoning_effort",
    "chat_template_kwargs",  # vLLM's: variables for the chat template (enable_thinking, ...)
}
# Refused unless null: field -> why.
REFUSED = {
    "suffix": "suffix is not supported (no fill-in-the-middle)",
    "functions": "functions (the deprecated form of tools) is not supported: send tools",
    "function_call": "function_call (the deprecated form of tool_choice) is not supported: send tool_choice",
    "audio": "audio output is not supported (a text model)",
    "prediction": "prediction (predicted outputs) is not supported",
    "web_search_options": "web_search_options is not supported (no web search)",
    "verbosity": "verbosity is not supported",
    "metadata": "metadata is not supported (it goes with store, and nothing is stored)",
}
CHAT_FIELDS |= {name for name in REFUSED if name != "suffix"}


@dataclass(frozen=True)
class Served:
    """What requests are checked against: the tokenizer, a row's context, the logits' vocabulary,
    the chat template and the tokens that end a chat turn, and how many sequences one request
    may start (more could never be queued at once)."""

    tokenizer: Tokenizer
    context: int
    vocab: int
    chat_template: ChatTemplate | None
    chat_stop_ids: tuple[int, ...]
    grammars: Grammars
    max_sequences: int
    tool_parser: str | None = None  # parsers/registry.py's names
    reasoning_parser: str | None = None


@dataclass
class Plan:
    chat: bool
    prompts: list[list[int]]  # token ids, one list a prompt
    echo_texts: list[str]  # each prompt's text, for echo
    params: list[list[SamplingParams]]  # per prompt, best_of sequences
    n: int
    best_of: int
    stream: bool
    include_usage: bool
    logprobs: int | None  # alternatives to report per token (None: no log-probabilities)
    echo: bool = False
    output: Callable[[], Output] | None = None  # a chat choice's parsing (tool calls, reasoning), per choice
    one_call: bool = False  # parallel_tool_calls: false
    reasoning: bool = False  # the reply's message has reasoning fields (a reasoning parser reads it)
    tool_names: dict = field(default_factory=dict)


class Fields:
    """A request body's fields, each read once with its type checked; null reads as absent."""

    def __init__(self, body: dict, known: set[str]):
        for name in body:
            if name not in known:
                raise ApiError(400, f"unknown field {short(name)}", name[:100])
            if name in REFUSED and body[name] is not None and not (name == "suffix" and body[name] == ""):
                raise ApiError(400, REFUSED[name], name)
        self.body = body

    def get(self, name: str, default, kinds: tuple[type, ...], what: str):
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ApiError(400, f"{name} must be {what}, got {_kind(value)}", name)
        return value

    def int(self, name: str, default, least: int | None = None, most: int | None = None):
        value = self.get(name, default, (int,), "an integer")
        if value is not None and (least is not None and value < least or most is not None and value > most):
            span = f">= {least}" if most is None else f"in [{least}, {most}]"
            raise ApiError(400, f"{name} must be an integer {span}, got {short(value)}", name)
        return value

    def number(self, name: str, default: float) -> float:
        return self.get(name, default, (int, float), "a number")

    def bool(self, name: str, default: bool = False) -> bool:
        return self.get(name, default, (bool,), "true or false")

    def string(self, name: str) -> str | None:
        value = self.get(name, None, (str,), "a string")
        if value is not None:
            _text(value, name)
        return value


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), f"a number ({short(value)})" if isinstance(value, (int, float)) else type(value).__name__
    )


def _text(value: str, param: str) -> None:
    try:
        check_text(value, param)
    except RequestError as e:
        raise bad(e) from None


# ---- completions -------------------------------------------------------------------------------


def completion_plan(body: dict, served: Served) -> Plan:
    fields = Fields(body, COMPLETION_FIELDS)
    texts, prompts = _prompts(body.get("prompt"), served)
    logprobs = fields.int("logprobs", None, 0, MAX_LOGPROBS)
    echo = fields.bool("echo")
    max_tokens = fields.int("max_tokens", 16)
    if max_tokens < (0 if echo else 1):
        least = "0 (with echo)" if echo else "1 (0 only with echo)"
        raise ApiError(400, f"max_tokens must be an integer >= {least}, got {max_tokens}", "max_tokens")
    n, best_of, stream, include_usage = _counts(fields, best_of_allowed=True)
    _fits(served, len(prompts) * best_of, "prompt" if len(prompts) > 1 else "n")
    # a sequence records its log-probabilities when they are asked for, or best_of ranks by them
    record = logprobs if logprobs is not None else (0 if best_of > n else None)
    # echo: the prompt's log-probabilities when asked for (and with max_tokens 0, which runs the prompt alone)
    prompt_logprobs = None
    if echo and (logprobs is not None or max_tokens == 0):
        prompt_logprobs = logprobs or 0
    base = _sampling(fields, served, max_tokens, record, prompt_logprobs, ())
    params = []
    for ids in prompts:
        _context(served, ids, base.max_tokens, "max_tokens", "prompt")
        params.append(_choices(base, best_of, ids, served))
    return Plan(False, prompts, texts, params, n, best_of, stream, include_usage, logprobs, echo)


def _prompts(prompt, served: Served) -> tuple[list[str], list[list[int]]]:
    """A string, a list of strings, a list of token ids or a list of such lists -> (texts, ids)."""
    what = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, what + (" (not empty)" if prompt == [] else ""), "prompt")
    if all(isinstance(p, str) for p in prompt):
        texts = prompt
        for i, text in enumerate(texts):
            _text(text, "prompt" if len(texts) == 1 else f"prompt[{i}]")
        try:
            return texts, [prompt_ids(served.tokenizer, text) for text in texts]
        except RequestError as e:
            raise bad(e) from None
    if all(_is_int(p) for p in prompt):
        prompt = [prompt]
    if not all(isinstance(p, list) and p and all(_is_int(i) for i in p) for p in prompt):
        raise ApiError(400, what + " (each non-empty)", "prompt")
    for ids in prompt:
        bad_id = next((i for i in ids if not 0 <= i < served.vocab), None)
        if bad_id is not None:
            raise ApiError(400, f"the prompt's token id {short(bad_id)} is not in [0, {served.vocab})", "prompt")
    return [served.tokenizer.decode(ids) for ids in prompt], prompt


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- chat completions --------------------------------------------------------------------------


def chat_plan(body: dict, served: Served) -> Plan:
    fields = Fields(body, CHAT_FIELDS)
    if served.chat_template is None:
        raise ApiError(
            400,
            "this model's tokenizer has no chat template (chat_template in tokenizer_config.json "
            "or chat_template.jinja beside tokenizer.json): use /v1/completions",
            "messages",
        )
    messages = _messages(body.get("messages"))
    for name in ("safety_identifier", "prompt_cache_key"):
        fields.string(name)
    if fields.bool("store"):
        raise ApiError(400, "store: nothing is stored on this server (store must be false)", "store")
    if fields.get("service_tier", "auto", (str,), "a string") not in ("auto", "default"):
        raise ApiError(400, "service_tier: this server has one tier (auto or default)", "service_tier")
    if fields.get("modalities", ["text"], (list,), "a list") != ["text"]:
        raise ApiError(400, 'modalities: only ["text"] (a text model)', "modalities")
    logprobs = fields.bool("logprobs")
    top = fields.int("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    n, best_of, stream, include_usage = _counts(fields, best_of_allowed=False)
    _fits(served, n, "n")
    tools = _tools(fields.get("tools", None, (list,), "a list of tools"))
    choice = _tool_choice(body.get("tool_choice"), tools)
    parallel = fields.bool("parallel_tool_calls", True)
    template_kwargs = _template_kwargs(fields, served)
    try:
        prompt = served.chat_template.render(messages, tools=tools or None, **template_kwargs)
        ids = served.tokenizer.encode(prompt)
    except RequestError as e:
        raise bad(e) from None
    # max_completion_tokens is OpenAI's name now, max_tokens the old one: the newer wins (vLLM's rule)
    newer, older = fields.int("max_completion_tokens", None, 1), fields.int("max_tokens", None, 1)
    max_tokens, name = (newer, "max_completion_tokens") if newer is not None else (older, "max_tokens")
    _context(served, ids, max_tokens or 1, name, "messages")
    if max_tokens is None:  # as much as the context holds, as OpenAI and vLLM do
        max_tokens = served.context - len(ids)
    record = (top or 0) if logprobs else None
    base = _sampling(fields, served, max_tokens, record, None, served.chat_stop_ids)
    ends = frozenset({served.tokenizer.eos_id, *base.stop_token_ids} - {None})
    forced = None
    if choice not in ("none", "auto"):
        if body.get("response_format") not in (None, {"type": "text"}):
            raise ApiError(
                400, f"tool_choice {_choice_name(choice)} and response_format cannot both be given", "tool_choice"
            )
        schema, forced = _forced(choice, tools, parallel)
        try:
            base = replace(base, grammar=served.grammars.schema(schema, ends, "tool_choice"))
        except RequestError as e:
            raise bad(e) from None
    elif body.get("response_format") is not None:
        try:
            base = replace(base, grammar=served.grammars.compile(body["response_format"], ends))
        except RequestError as e:
            raise bad(e) from None
    for i, tool in enumerate(tools):  # a strict tool's schema must compile (the grammar enforces it when forced)
        function = tool["function"]
        if function.get("strict") and forced is None and grammar_available():
            try:
                served.grammars.schema(function.get("parameters") or {"type": "object"}, ends, f"tools[{i}]")
            except RequestError as e:
                raise ApiError(400, str(e), "tools") from None
    parse = None
    calls = bool(tools) and choice != "none"
    reads = served.tool_parser is not None or served.reasoning_parser is not None
    if forced is not None or reads:
        parse = functools.partial(
            output,
            served.tool_parser,
            served.reasoning_parser,
            tools=calls,
            # a grammar (response_format) constrains the first token on: no reasoning comes first
            reasoning_open=opened_in_prompt(prompt) and base.grammar is None,
            forced=forced,
        )
        # the parsers read the markers, which are special tokens in some tokenizers (gpt-oss's channels)
        base = replace(base, skip_special_tokens=not reads)
    return Plan(
        True,
        [ids],
        [""],
        [_choices(base, best_of, ids, served)],
        n,
        best_of,
        stream,
        include_usage,
        record,
        output=parse,
        one_call=not parallel,
        reasoning=served.reasoning_parser is not None,
    )


# ---- tools -------------------------------------------------------------------------------------


def _tools(tools) -> list[dict]:
    """OpenAI's function tools, checked: [{"type": "function", "function": {name, description?,
    parameters?, strict?}}], names unique. Given to the template as sent."""
    if tools is None:
        return []
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ApiError(400, f"{where}: only function tools are supported, got type {short(kind)}", "tools")
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f"{where}.function must be an object with a name", "tools")
        unknown = sorted(set(tool) - {"type", "function"}) or sorted(
            set(function) - {"name", "description", "parameters", "strict"}
        )
        if unknown:
            raise ApiError(400, f"{where} has an unknown field {short(unknown[0])}", "tools")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise ApiError(400, f"{where}.function.parameters must be a JSON schema (an object)", "tools")
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise ApiError(400, f"{where}.function.description must be a string", "tools")
        if not isinstance(function.get("strict", False), (bool, type(None))):
            raise ApiError(400, f"{where}.function.strict must be true or false", "tools")
        if function["name"] in names:
            raise ApiError(400, f"{where}: two tools are named {short(function['name'])}", "tools")
        names.add(function["name"])
        for key in ("name", "description"):
            if isinstance(function.get(key), str):
                _text(function[key], f"{where}.function.{key}")
    return tools


def _tool_choice(choice, tools: list[dict]):
    """ "none" | "auto" | "required" | ("function", name); auto by default (none without tools)."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(
                400, f"tool_choice must be none, auto, required or a named function, got {short(choice)}", "tool_choice"
            )
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice} needs tools", "tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400, 'tool_choice must be a string or {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"tool_choice names {short(name)}, which is not one of the tools", "tool_choice")
    return ("function", name)


def _choice_name(choice) -> str:
    return choice if isinstance(choice, str) else f"{{function {choice[1]}}}"


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _forced(choice, tools: list[dict], parallel: bool) -> tuple[dict, Callable]:
    """The schema that forces tool_choice (vLLM's forms) and the parser of what it forces."""
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        return schema, Required
    name = choice[1]
    tool = next(t for t in tools if t["function"]["name"] == name)
    return _parameters(tool), functools.partial(Named, name)


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
RESERVED_TEMPLATE_NAMES = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}


def _template_kwargs(fields: Fields, served: Served) -> dict:
    """chat_template_kwargs and reasoning_effort, for the template (which must read the latter)."""
    kwargs = dict(fields.get("chat_template_kwargs", {}, (dict,), "an object"))
    taken = sorted(RESERVED_TEMPLATE_NAMES & set(kwargs))
    if taken:
        raise ApiError(
            400,
            f"chat_template_kwargs: {short(taken[0])} is the request's own (not a template variable to set)",
            "chat_template_kwargs",
        )
    effort = fields.get("reasoning_effort", None, (str,), "a string")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise ApiError(
                400,
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {short(effort)}",
                "reasoning_effort",
            )
        if not served.chat_template.reads("reasoning_effort"):
            raise ApiError(
                400,
                "reasoning_effort: this model's chat template has no reasoning effort (it reads no reasoning_effort)",
                "reasoning_effort",
            )
        kwargs["reasoning_effort"] = effort
    return kwargs


ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages) -> list[dict]:
    """Messages as the template reads them: role, content (text parts joined), name and
    tool_call_id when given (strings), and any other key as sent: a template may read keys of its
    own (Qwen3's `reasoning_content`, say), as vLLM passes them."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {short(role)}", "messages")
        if message.get("function_call"):
            raise ApiError(
                400, f"{where}.function_call (the deprecated form) is not supported: send tool_calls", "messages"
            )
        content = message.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):  # parts: text only
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else None
                    raise ApiError(
                        400,
                        f"{where}.content[{j}]: only text parts are supported (a text model), got {short(kind)}",
                        "messages",
                    )
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", "messages")
        _text(content, f"{where}.content")
        item = {**message, "role": role, "content": content}
        if message.get("tool_calls"):
            if role != "assistant":
                raise ApiError(400, f"{where}.tool_calls: only an assistant message has tool calls", "messages")
            item["tool_calls"] = _message_calls(message["tool_calls"], where)
        for name, value in message.items():
            if name in ("name", "tool_call_id") and value is not None and not isinstance(value, str):
                raise ApiError(400, f"{where}.{name} must be a string", "messages")
            if isinstance(value, str) and name != "content":
                _text(value, f"{where}.{name}")
        out.append(item)
    return out


def _message_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them: OpenAI's
    {id, type, function: {name, arguments}} with the arguments (a JSON string) as the object, as
    transformers' templates expect (Qwen3's writes `arguments | tojson`)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError(400, f"{at} must be {{id, type: function, function: {{name, arguments}}}}", "messages")
        if call.get("type", "function") != "function":
            raise ApiError(400, f"{at}.type must be function", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            _text(arguments, f"{at}.function.arguments")
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError):
                raise ApiError(400, f"{at}.function.arguments is not JSON", "messages") from None
        if not isinstance(arguments, dict):
            raise ApiError(400, f"{at}.function.arguments must be a JSON object", "messages")
        out.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return out


# ---- what both share ---------------------------------------------------------------------------


def _counts(fields: Fields, best_of_allowed: bool) -> tuple[int, int, bool, bool]:
    """(n, best_of, stream, include_usage)."""
    n = fields.int("n", 1, 1)
    best_of = fields.int("best_of", n, 1) if best_of_allowed else n
    if best_of < n:
        raise ApiError(400, f"best_of ({best_of}) must be at least n ({n})", "best_of")
    stream = fields.bool("stream")
    if stream and best_of > n:
        raise ApiError(400, "best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    options = fields.get("stream_options", None, (dict,), "an object")
    include_usage = False
    if options is not None:
        if not stream:
            raise ApiError(400, "stream_options is allowed only with stream: true", "stream_options")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise ApiError(400, f"stream_options has an unknown field {short(unknown[0])}", "stream_options")
        include_usage = Fields(options, {"include_usage"}).get("include_usage", False, (bool,), "true or false")
    return n, best_of, stream, include_usage


def _fits(served: Served, sequences: int, param: str) -> None:
    if sequences > served.max_sequences:
        raise ApiError(
            400,
            f"the request asks for {sequences} sequences (prompts × best_of or n); this server takes at most "
            f"{served.max_sequences} at once",
            param,
        )


_TOKEN_ID = re.compile(r"[0-9]+")


def _sampling(
    fields: Fields,
    served: Served,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
    turn_stops: tuple[int, ...],
) -> SamplingParams:
    stop = fields.get("stop", [], (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or a list of them", "stop")
    for s in stop:
        _text(s, "stop")
    stop_ids = fields.get("stop_token_ids", [], (list,), "a list of token ids")
    if not all(_is_int(i) for i in stop_ids):
        raise ApiError(400, "stop_token_ids must be a list of token ids", "stop_token_ids")
    bias = fields.get("logit_bias", {}, (dict,), "an object of token ids (strings) to numbers")
    pairs = []
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or len(key) > 12:
            raise ApiError(400, f"logit_bias: the key {short(key)} is not a token id", "logit_bias")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ApiError(
                400, f"logit_bias: the bias of token {key} must be a number, got {_kind(value)}", "logit_bias"
            )
        pairs.append((int(key), value))
    fields.string("user")
    seed = fields.get("seed", None, (int,), "an integer")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=fields.number("temperature", 1.0),  # OpenAI's default, not greedy
        top_p=fields.number("top_p", 1.0),
        seed=secrets.randbits(63) if seed is None else seed % SEED_MODULUS,
        stop=tuple(stop),
        stop_token_ids=tuple(dict.fromkeys([*turn_stops, *stop_ids])),
        presence_penalty=fields.number("presence_penalty", 0.0),
        frequency_penalty=fields.number("frequency_penalty", 0.0),
        repetition_penalty=fields.number("repetition_penalty", 1.0),
        logit_bias=tuple(pairs),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    try:
        params.check(served.vocab)
    except RequestError as e:
        raise bad(e) from None
    return params


def _context(served: Served, ids: list[int], max_tokens: int, name: str, prompt_param: str) -> None:
    if len(ids) >= served.context:
        raise ApiError(
            400,
            f"the prompt has {len(ids)} tokens; the context holds {served.context}",
            prompt_param,
            "context_length_exceeded",
        )
    if len(ids) + max_tokens > served.context:
        raise ApiError(
            400,
            f"{name} ({max_tokens}) and the prompt ({len(ids)} tokens) exceed the context ({served.context} tokens)",
            name,
            "context_length_exceeded",
        )


def _choices(base: SamplingParams, count: int, ids: list[int], served: Served) -> list[SamplingParams]:
    """`count` sequences of a prompt: the same settings, seeds derived from the request's."""
    choices = [replace(base, seed=derived_seed(base.seed, i)) for i in range(count)]
    for params in choices:
        try:
            check_request(ids, params, served.context, served.vocab)
        except RequestError as e:
            raise bad(e) from None
    return choices


def derived_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's for choice 0, else a SplitMix64 hash of both (mod 2**63)."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) % SEED_MODULUS
