"""Chat and instruction rows: each JSONL row read in its format, rendered by the model's chat
template, tokenized once, with the tokens that train marked.

Formats (`data.format`, or "auto": from the first row's keys):
  messages           {"messages": [{"role", "content", "tool_calls", "reasoning_content"}, ...], "tools"?}
                     (OpenAI; roles system, developer, user, assistant, tool)
  sharegpt           {"conversations": [{"from", "value"}, ...]}: human -> user, gpt -> assistant,
                     system, observation -> tool (and the OpenAI role names)
  prompt_completion  {"prompt", "completion"}: two strings (the text prompt + completion, then the
                     end-of-document token), or two message lists (a conversation)
  alpaca             {"instruction", "input"?, "output"}: a user turn (instruction, a blank line,
                     input) and the assistant's output; without a chat template, Alpaca's own prompt

What trains (`data.train_on`): "assistant" — each assistant message as the template renders it
(its reasoning and tool calls included) with the end of turn that follows it (`<|im_end|>` for
ChatML), not the role header before it, nor the whitespace after; "last_assistant" — the last
one only; "all" — every token. A prompt/completion row trains its completion. The spans come
from the template: its `{% generation %}` blocks where it has them, else by rendering the
conversation turn by turn — the prompt up to each assistant message (with the generation prompt)
and the conversation up to its end must each begin the whole rendering, or the template is not
prefix-preserving and the row is refused, naming what to do. A token trains when its first
character lies in a span.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moemesh.data.template import ChatTemplate
from moemesh.data.tokenizer import ByteTokenizer, Tokenizer
from moemesh.errors import DataError

ROLES = ("system", "developer", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "observation": "tool", **{r: r for r in ROLES}}
# A format's keys, as "auto" recognises it from a row.
FORMAT_KEYS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "prompt_completion": ("prompt", "completion"),
    "alpaca": ("instruction", "output"),
    "text": ("text",),
}
ALPACA_PROMPT = (
    "Below is an instruction that describes a task{context}. Write a response that appropriately completes the "
    "request.\n\n### Instruction:\n{instruction}\n\n{input}### Response:\n"
)


@dataclass
class Row:
    """A row's tokens and which of them train (each token predicted from those before it)."""

    ids: np.ndarray  # int64 [n]
    trained: np.ndarray  # bool [n]
    line: int  # its line in the file


def detect_format(record: object, where: str) -> str:
    if isinstance(record, dict):
        for name, keys in FORMAT_KEYS.items():
            if all(key in record for key in keys):
                return name
    keys = ", ".join(map(repr, record)) if isinstance(record, dict) else type(record).__name__
    raise DataError(
        f"{where}: cannot tell the data's format from its keys ({keys}): expected "
        '"messages", "conversations", "prompt" and "completion", "instruction" and "output", or "text"'
    )


class RowReader:
    """Rows of one format -> `Row`s, by one template and one tokenizer."""

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None, fmt: str, train_on: str, file: Path):
        self.tokenizer, self.template, self.format, self.train_on, self.file = tokenizer, template, fmt, train_on, file
        if fmt in ("messages", "sharegpt") and template is None:
            raise DataError(
                f"{file} holds conversations ({fmt}), but the tokenizer has no chat template: a tokenizer.json "
                "with one beside it (train.init_from brings it), or data.chat_template naming a Jinja file"
            )

    def read(self, record: object, line: int) -> Row:
        where = f"{self.file} line {line}"
        if not isinstance(record, dict) or not all(key in record for key in FORMAT_KEYS[self.format]):
            keys = " and ".join(f'"{k}"' for k in FORMAT_KEYS[self.format])
            raise DataError(f"{where}: expected an object with {keys} (data.format = {self.format!r})")
        try:
            if self.format in ("messages", "sharegpt"):
                key = "messages" if self.format == "messages" else "conversations"
                messages = _messages(record[key], self.format, key)
                tools = record.get("tools")
                if tools is not None and not isinstance(tools, list):
                    raise DataError('"tools" must be a list')
                text, spans = self._conversation(messages, None, tools)
            elif self.format == "prompt_completion":
                text, spans = self._prompt_completion(record["prompt"], record["completion"], record.get("tools"))
            else:
                text, spans = self._alpaca(record)
        except DataError as e:
            raise DataError(f"{where}: {e}") from None
        ids, starts = encode_with_offsets(self.tokenizer, text)
        trained = _in_spans(starts, spans)
        if (self.format == "prompt_completion" and isinstance(record["prompt"], str)) or self._plain_alpaca:
            # a text row ends its document as a text file's does
            if self.tokenizer.eos_id is not None:
                ids, trained = np.append(ids, self.tokenizer.eos_id), np.append(trained, True)
        if self.train_on == "all":
            trained = np.ones_like(trained)
        if len(trained):
            trained[0] = False  # nothing predicts a row's first token
        if not trained.any():
            raise DataError(f"{where}: no token of the row trains (data.train_on = {self.train_on!r})")
        return Row(ids, trained, line)

    @property
    def _plain_alpaca(self) -> bool:
        return self.format == "alpaca" and self.template is None

    # ---- spans ----------------------------------------------------------------------------------
    def _conversation(
        self, messages: list[dict], trained: list[int] | None, tools: list | None
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and its trained character spans: of the messages `trained`
        indexes (None: the assistant messages, as data.train_on says)."""
        template = self.template
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if trained is None:
            trained = assistant[-1:] if self.train_on == "last_assistant" else assistant
        if not trained and self.train_on != "all":
            raise DataError("the conversation has no assistant message to train on")
        if template.has_generation_markers:
            text, spans = template.render_marked(messages, tools)
            if not spans and self.train_on != "all":
                raise DataError("the chat template's {% generation %} blocks marked nothing in the conversation")
            return text, spans[-1:] if self.train_on == "last_assistant" else spans
        full = template.render(messages, False, tools, DataError)
        spans = []
        for i in trained:
            prompt = template.render(messages[:i], True, tools, DataError)
            turn = template.render(messages[: i + 1], False, tools, DataError)
            if not full.startswith(prompt) or not full.startswith(turn) or not turn.startswith(prompt):
                raise DataError(
                    f"the chat template is not prefix-preserving: message {i} (an assistant's) renders differently "
                    "alone than within the conversation (Qwen3's template drops the <think> of assistant turns "
                    "before the last user message), so its trained tokens cannot be found: data.train_on = "
                    '"last_assistant", or a template with {% generation %} markers as data.chat_template'
                )
            spans.append((len(prompt), len(turn.rstrip())))
        return full, spans

    def _prompt_completion(self, prompt, completion, tools) -> tuple[str, list[tuple[int, int]]]:
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
        if not (isinstance(prompt, list) and isinstance(completion, list)):
            raise DataError('"prompt" and "completion" must be two strings or two lists of messages')
        if self.template is None:
            raise DataError("a prompt/completion of messages needs a chat template (data.chat_template)")
        prompt_messages = _messages(prompt, "messages", "prompt")
        messages = prompt_messages + _messages(completion, "messages", "completion")
        full = self.template.render(messages, False, tools, DataError)
        start = self.template.render(prompt_messages, True, tools, DataError)
        if not full.startswith(start):
            raise DataError("the chat template renders the prompt differently within the whole conversation")
        if self.train_on == "last_assistant":
            return self._conversation(messages, None, tools)
        return full, [(len(start), len(full.rstrip()))]

    def _alpaca(self, record: dict) -> tuple[str, list[tuple[int, int]]]:
        instruction, extra, output = record["instruction"], record.get("input") or "", record["output"]
        if not all(isinstance(v, str) for v in (instruction, extra, output)):
            raise DataError('"instruction", "input" and "output" must be strings')
        if self.template is None:
            prompt = ALPACA_PROMPT.format(
                context=", paired with an input that provides further context" if extra else "",
                instruction=instruction,
                input=f"### Input:\n{extra}\n\n" if extra else "",
            )
            return prompt + output, [(len(prompt), len(prompt) + len(output))]
        user = instruction + (f"\n\n{extra}" if extra else "")
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        return self._conversation(messages, None, None)


def _messages(value: object, fmt: str, key: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(f'"{key}" must be a non-empty list of messages')
    messages = []
    for n, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(f'"{key}"[{n}] is not an object')
        if fmt == "sharegpt":
            speaker = message.get("from")
            if speaker not in SHAREGPT_ROLES:
                raise DataError(
                    f'"{key}"[{n}]: unknown "from" {speaker!r} (expected one of {", ".join(SHAREGPT_ROLES)})'
                )
            if not isinstance(message.get("value"), str):
                raise DataError(f'"{key}"[{n}]: "value" must be a string')
            messages.append({"role": SHAREGPT_ROLES[speaker], "content": message["value"]})
            continue
        role = message.get("role")
        if role not in ROLES:
            raise DataError(f'"{key}"[{n}]: unknown role {role!r} (expected one of {", ".join(ROLES)})')
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise DataError(f'"{key}"[{n}]: a {role} message needs "content"')
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f'"{key}"[{n}]: "content" must be a string or a list of parts')
        if message.get("tool_calls") is not None and not isinstance(message["tool_calls"], list):
            raise DataError(f'"{key}"[{n}]: "tool_calls" must be a list')
        message = dict(message)
        if content is None:  # an assistant's turn of tool calls alone: "" as serve gives it
            message["content"] = ""
        if message.get("tool_calls"):
            message["tool_calls"] = [
                _call(call, f'"{key}"[{n}].tool_calls[{j}]') for j, call in enumerate(message["tool_calls"])
            ]
        messages.append(message)
    return messages


def _call(call: object, where: str) -> object:
    """A tool call with OpenAI's arguments (a JSON string) as the object, as serve gives a
    request's calls to the template (inference/protocol.py): a model trains on what it is served."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call  # arguments already an object, or a call of the template's own shape
    try:
        arguments = json.loads(function["arguments"]) if function["arguments"].strip() else {}
    except (ValueError, RecursionError):
        raise DataError(f"{where}.function.arguments is not JSON") from None
    if not isinstance(arguments, dict):
        raise DataError(f"{where}.function.arguments must be a JSON object")
    return {**call, "function": {**function, "arguments": arguments}}


def encode_with_offsets(tokenizer: Tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, the character index in `text` where each token starts)."""
    if isinstance(tokenizer, ByteTokenizer):
        raw = text.encode("utf-8")
        widths = [len(c.encode("utf-8")) for c in text]
        return np.frombuffer(raw, dtype=np.uint8).astype(np.int64), np.repeat(np.arange(len(text)), widths)
    encoding = tokenizer.encode_with_offsets(text)
    return np.asarray(encoding[0], dtype=np.int64), np.asarray(encoding[1], dtype=np.int64)


def _in_spans(starts: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    trained = np.zeros(len(starts), dtype=bool)
    for a, b in spans:
        trained |= (starts >= a) & (starts < b)
    return trained


def read_rows(
    file: Path, values: Iterator[tuple[int, object]], tokenizer: Tokenizer, template, fmt: str, train_on: str
) -> tuple[str, list[Row]]:
    """(the format, every row of a JSONL file's parsed values), each checked before training."""
    values = iter(values)
    first = next(values, None)
    if first is None:
        raise DataError(f"{file} holds no rows")
    if fmt == "auto":
        fmt = detect_format(first[1], f"{file} line {first[0]}")
    reader = RowReader(tokenizer, template, fmt, train_on, file)
    rows = [reader.read(first[1], first[0])]
    rows += [reader.read(record, line) for line, record in values]
    return fmt, rows
