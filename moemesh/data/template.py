"""Chat templates: a checkpoint's chat template (Jinja), rendered as transformers renders it, for
serving (`inference/`) and for training on conversations (`data/chat.py`) alike.

The template is the tokenizer's: `chat_template.jinja` beside its tokenizer.json, else the
`chat_template` of tokenizer_config.json there (a string, or a list of named templates of which
"default" is taken); `data.chat_template` may name another file. It is compiled in Jinja's
immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks, a `tojson` filter,
`raise_exception` and `strftime_now`) and rendered with the messages, `add_generation_prompt` and
the config's bos/eos tokens. The eos token also ends a reply: a chat turn ends with it, whatever
ends a document — and so does the template's own end of turn (`end_of_turn`), which a base model's
eos may not be (Qwen3's base models end documents with <|endoftext|>, turns with <|im_end|>).

`{% generation %} ... {% endgeneration %}` (transformers' markers of what the assistant writes)
render their body; `render_marked` also returns the character spans of the bodies.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import DataError, MoemeshError, RequestError

# Private-use characters around a generation block's output while its spans are recorded.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PROBE = "\ue002"  # an assistant's content, to see what a template writes after it


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            text = caller()
            return f"{_OPEN}{text}{_CLOSE}" if self.environment.globals.get("_marking") else text

    return Generation


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _generation_extension()],
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(
            raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt)
        )
        self.env, self.source = env, source
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.has_generation_markers = "{% generation %}" in source or "{%- generation %}" in source
        self._end_of_turn: str | None = None

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        error: type[MoemeshError] = RequestError,
        **kwargs,
    ) -> str:
        """The conversation as text; a template that refuses it or fails on it raises `error`
        (RequestError for a request, naming its messages; DataError for a row of data). `kwargs`:
        what a request adds for the template (`reasoning_effort`, its `chat_template_kwargs`)."""
        from jinja2.exceptions import TemplateError

        args = () if error is not RequestError else ("messages",)
        extra = {} if tools is None else {"tools": tools}
        try:
            return self.template.render(
                **kwargs,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError as e:  # the template's own checks (roles in order, ...): raise_exception
            raise error(f"the chat template refused the messages: {e}", *args) from None
        except Exception as e:  # a template that trips over the messages (a None where it adds strings, ...)
            raise error(f"the chat template failed on the messages ({type(e).__name__}: {e})", *args) from None

    def reads(self, name: str) -> bool:
        """Whether the template's source names a variable (reasoning_effort, say)."""
        return name in self.source

    def render_marked(
        self, messages: list[dict], tools: list | None = None, error: type[MoemeshError] = DataError
    ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation (no generation prompt) and the [start, end) character spans of its
        `{% generation %}` blocks."""
        self.env.globals["_marking"] = True
        try:
            marked = self.render(messages, False, tools, error)
        finally:
            self.env.globals["_marking"] = False
        text, spans, start = [], [], None
        length = 0
        for piece in _split_marks(marked):
            if piece == _OPEN:
                start = length
            elif piece == _CLOSE:
                if start is not None:
                    spans.append((start, length))
                start = None
            else:
                text.append(piece)
                length += len(piece)
        return "".join(text), [(a, b) for a, b in spans if b > a]

    @property
    def end_of_turn(self) -> str:
        """What the template writes after an assistant's content, up to the next turn, without
        the whitespace that follows (`<|im_end|>` for ChatML); "" if it writes nothing."""
        if self._end_of_turn is None:
            try:
                text = self.render(
                    [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}], False, error=DataError
                )
            except DataError:
                text = ""
            self._end_of_turn = text.rpartition(_PROBE)[2].strip() if _PROBE in text else ""
        return self._end_of_turn


def _split_marks(text: str) -> list[str]:
    pieces, current = [], []
    for char in text:
        if char in (_OPEN, _CLOSE):
            pieces += ["".join(current), char]
            current = []
        else:
            current.append(char)
    pieces.append("".join(current))
    return [p for p in pieces if p]


def load_chat_template(tokenizer: Tokenizer, path: str | Path = "") -> ChatTemplate | None:
    """The template beside the tokenizer's tokenizer.json (or the Jinja file `path` names, with
    the special tokens beside the tokenizer), or None (the byte tokenizer has none)."""
    tokenizer_path = getattr(tokenizer, "path", None)
    config: dict = {}
    if tokenizer_path is not None:
        config_path = Path(tokenizer_path).parent / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"cannot read {config_path}: {e}") from None

    def token(name):
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    if path:
        file = Path(path)
        if not file.is_file():
            raise DataError(f"data.chat_template: no such file {file} (a Jinja chat template)")
        return _compiled(file.read_text(encoding="utf-8"), token("bos_token"), token("eos_token"), file)
    if tokenizer_path is None:
        return None
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja = Path(tokenizer_path).parent / "chat_template.jinja"
    if jinja.is_file():
        source = jinja.read_text()
    if not source:
        return None
    return _compiled(source, token("bos_token"), token("eos_token"), Path(tokenizer_path).parent)


def _compiled(source: str, bos: str | None, eos: str | None, where: Path) -> ChatTemplate:
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return ChatTemplate(source, bos, eos)
    except TemplateSyntaxError as e:
        raise DataError(f"the chat template of {where} does not compile: {e} (line {e.lineno})") from None
