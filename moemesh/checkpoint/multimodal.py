"""Multimodal checkpoints whose language model moemesh runs (Gemma-4's hub checkpoints are
`Gemma4ForConditionalGeneration`).

Their config.json nests the language model's config under `text_config`; their weights hold the
language model under a prefix (`model.language_model.`), `lm_head.weight` when it is not tied to the
embedding, and vision/audio towers and embedders that moemesh does not model: those are skipped,
anything else is an error. moemesh saves the text model alone (Gemma4ForCausalLM).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moemesh.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Multimodal:
    architecture: str
    text_model_type: str  # the model_type text_config must have
    text_prefix: str  # where the language model's weights are
    skipped_prefixes: tuple[str, ...]  # the parts moemesh does not model
    tie_default: bool  # tie_word_embeddings when the outer config leaves it out

    def text_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The language model's config.json dict."""
        text = hf.get("text_config")
        if not isinstance(text, dict) or text.get("model_type") != self.text_model_type:
            got = text.get("model_type") if isinstance(text, dict) else text
            raise ConfigError(
                f"model config: a {hf['model_type']} ({self.architecture}) config needs a text_config "
                f"of model_type {self.text_model_type!r}, got {got!r}"
            )
        text = dict(text)
        # transformers ties the head by the outer config's flag, and writes the dtype there
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", self.tie_default)
        for key in ("dtype", "torch_dtype"):
            if key in hf:
                text.setdefault(key, hf[key])
        return text

    def text_name(self, key: str) -> str | None:
        """A checkpoint tensor's name in the text model, None for a skipped part; CheckpointError
        for a tensor of neither kind."""
        if key.startswith(self.text_prefix):
            return "model." + key.removeprefix(self.text_prefix)
        if key == "lm_head.weight":
            return key
        if key.startswith(self.skipped_prefixes):
            return None
        raise CheckpointError(
            f"unexpected weight {key!r} in a {self.architecture} checkpoint (neither the language "
            f"model under {self.text_prefix!r}, lm_head, nor the parts moemesh skips: "
            f"{', '.join(self.skipped_prefixes)})"
        )


WRAPPERS = {
    "gemma4": Multimodal(
        "Gemma4ForConditionalGeneration",
        "gemma4_text",
        "model.language_model.",
        ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio."),
        tie_default=True,
    ),
}
