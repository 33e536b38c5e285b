"""The model families moemesh knows, by `model_type`. Importing this module imports each family's
module, which registers its family (`family.register`); `models/__init__.py` imports it, so any use of
`moemesh.models` finds them all."""

from __future__ import annotations

from moemesh.models import deepseek, gemma4, gpt_oss, mixtral, qwen3_moe
from moemesh.models.family import Family, family

FAMILIES: dict[str, Family] = {
    f.model_type: f for f in [qwen3_moe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY, deepseek.V2, deepseek.V3, gemma4.FAMILY]
}

__all__ = ["FAMILIES", "family"]
