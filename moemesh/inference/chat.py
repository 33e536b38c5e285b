"""Chat prompts: a checkpoint's chat template (Jinja), rendered as transformers renders it.

The template is the tokenizer's: `chat_template.jinja` beside its tokenizer.json, else the
`chat_template` of tokenizer_config.json there (a string, or a list of named templates of which
"default" is taken). It is compiled in Jinja's immutable sandbox with transformers' settings
(trim_blocks, lstrip_blocks, a `tojson` filter, `raise_exception` and `strftime_now`) and
rendered with the messages, `add_generation_prompt=True` and the config's bos/eos tokens, and
what a request adds: its `tools` (the list of `{"type": "function", "function": {...}}` as sent,
which transformers passes too), `reasoning_effort` and its `chat_template_kwargs` (such as
Qwen3's `enable_thinking`). The eos token also ends a reply: a chat turn ends with it, whatever
ends a document.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import DataError, RequestError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals.update(
            raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt)
        )
        self.template = env.from_string(source)
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token

    def reads(self, name: str) -> bool:
        """Whether the template's source names a variable (reasoning_effort, say)."""
        return name in self.source

    def render(self, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(
                **kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as e:  # the template's own checks (roles in order, ...): raise_exception
            raise RequestError(f"the chat template refused the messages: {e}", "messages") from None
        except Exception as e:  # a template that trips over the messages (a None where it adds strings, ...)
            raise RequestError(
                f"the chat template failed on the messages ({type(e).__name__}: {e})", "messages"
            ) from None


def load_chat_template(tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template beside the tokenizer's tokenizer.json, or None (the byte tokenizer has none)."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return None
    config_path = Path(path).parent / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {config_path}: {e}") from None
    source = config.get("chat_template")
    if isinstance(source, list):
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    jinja = Path(path).parent / "chat_template.jinja"
    if jinja.is_file():
        source = jinja.read_text()
    if not source:
        return None

    def token(name):
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    return ChatTemplate(source, token("bos_token"), token("eos_token"))
