"""The model families moemesh knows, by `model_type`."""

from __future__ import annotations

import difflib

from moemesh.errors import ConfigError
from moemesh.models import deepseek, gemma4, gpt_oss, mixtral, qwen3_moe
from moemesh.models.family import Family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in [qwen3_moe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY, deepseek.V2, deepseek.V3, gemma4.FAMILY]
}


def family(model_type: str | None) -> Family:
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    close = difflib.get_close_matches(str(model_type), FAMILIES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(f"unknown model_type {model_type!r}{hint}; supported: {', '.join(sorted(FAMILIES))}")
