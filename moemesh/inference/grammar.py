"""Structured output — OpenAI's response_format `json_object` and `json_schema` — by constrained
decoding with llguidance, the library behind vLLM's "guidance" backend (vLLM and SGLang default
to xgrammar, which reads the tokenizer as transformers loads it and brings a second runtime;
llguidance reads a tokenizer.json or a list of byte strings, installs alone as one wheel, and its
JSON-schema coverage is the widest). `pip install moemesh[serve]`; without it such a request
gets a 400 naming response_format.

Before each token, a request's matcher says which tokens keep the text a prefix of something the
schema accepts (processing.py puts the others at -inf), then takes the token drawn. The tokens
that end the request (the end-of-document token, a chat turn's end, stop_token_ids) are allowed
once the JSON is complete. A text cut by max_tokens or a stop string is cut JSON, as with OpenAI.
Limits: `strict` is taken as given by the schema (additionalProperties is allowed unless the
schema says false); one matcher runs on the host per token (~50 us for a 128k vocabulary).
"""

from __future__ import annotations

import functools
import json

from moemesh.data.tokenizer import Tokenizer
from moemesh.errors import RequestError
from moemesh.inference.request import short


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


class Grammars:
    """Grammars and matchers for one tokenizer and a model's vocabulary of `vocab` logits."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.tokenizer, self.vocab = tokenizer, vocab

    def compile(self, response_format, end_ids: frozenset[int]) -> str | None:
        """The llguidance grammar of a response_format ({"type": "text" | "json_object" |
        "json_schema", ...}), None for text; a RequestError naming the field when it is malformed
        or llguidance is missing."""
        if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
            raise RequestError("response_format must be an object with a type", "response_format")
        kind = response_format["type"]
        allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
        if allowed is None:
            raise RequestError(
                f"response_format.type must be text, json_object or json_schema, got {short(kind)}", "response_format"
            )
        extra = sorted(set(response_format) - allowed)
        if extra:
            raise RequestError(f"response_format has an unknown field {short(extra[0])}", "response_format")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = {"type": "object"}
        else:
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise RequestError("response_format.json_schema must be an object with a name", "response_format")
            extra = sorted(set(spec) - {"name", "description", "schema", "strict"})
            if extra:
                raise RequestError(
                    f"response_format.json_schema has an unknown field {short(extra[0])}", "response_format"
                )
            schema = spec.get("schema", {})
            if not isinstance(schema, dict) or not isinstance(spec.get("strict", False), (bool, type(None))):
                raise RequestError(
                    "response_format.json_schema: schema must be an object and strict a boolean", "response_format"
                )
        return self.schema(schema, end_ids, "response_format")

    def schema(self, schema: dict, end_ids: frozenset[int], param: str) -> str:
        """The llguidance grammar of a JSON schema (response_format's, or tool_choice's: a named
        tool's parameters, or `required`'s list of calls); a RequestError naming `param` when it
        cannot compile or llguidance is missing."""
        if not available():
            raise RequestError(
                f"{param}: constrained decoding (json_object / json_schema, tool_choice required or named, "
                "strict tools) needs llguidance, not installed on this server (pip install moemesh[serve])",
                param,
            )
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults={"whitespace_flexible": False}
            )
        except (ValueError, TypeError) as e:
            raise RequestError(f"{param}: the schema is not usable: {short(str(e), 200)}", param) from None
        matcher = self.matcher(grammar, end_ids)
        if matcher.is_error():
            raise RequestError(f"{param}: the schema is not usable: {short(matcher.get_error(), 200)}", param)
        return grammar

    def matcher(self, grammar: str, end_ids: frozenset[int]):
        """A fresh matcher at the start of `grammar`, ending at any of `end_ids`."""
        import llguidance

        return llguidance.LLMatcher(self._tokenizer(tuple(sorted(end_ids))), grammar, log_level=0)

    @functools.lru_cache(maxsize=4)  # noqa: B019 (one Grammars per server; building one costs ~1 s for 128k tokens)
    def _tokenizer(self, end_ids: tuple[int, ...]):
        import llguidance

        path = getattr(self.tokenizer, "path", None)
        if path is None:  # the byte tokenizer: one token a byte
            wrapper = llguidance.TokenizerWrapper(_ByteTokens(self.tokenizer, self.vocab))
            return llguidance.LLTokenizer(wrapper, n_vocab=self.vocab, eos_token=list(end_ids))
        return llguidance.LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=self.vocab, eos_token=list(end_ids))


class _ByteTokens:
    """The byte tokenizer as llguidance's TokenizerWrapper reads one."""

    def __init__(self, tokenizer: Tokenizer, vocab: int):
        self.eos_token_id, self.bos_token_id = tokenizer.eos_id, None
        self.tokens = [bytes([i]) if i < 256 else b"" for i in range(vocab)]
        self.special_token_ids = [tokenizer.eos_id]
        self._tokenizer = tokenizer

    def __call__(self, text):
        return self._tokenizer.encode(text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text)
