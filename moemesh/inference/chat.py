"""Chat prompts: a checkpoint's chat template, rendered as transformers renders it, with
`add_generation_prompt=True`. The template and its loading live in `data/template.py`, which the
training data's conversations share."""

from __future__ import annotations

from moemesh.data.template import ChatTemplate, load_chat_template

__all__ = ["ChatTemplate", "load_chat_template"]
