"""Generation for many prompts at once: `generate` runs them through the decode engine and the
scheduler (continuous batching), each with its own settings and stops, and returns them in
order. `load_for_generation` is the one way the engine, `moemesh generate` and `moemesh serve`
get a model and its tokenizer.

A prompt's text is preceded by the end-of-document token, as a document is in training, so that
it reads as the start of a document.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence as Seq

import torch

from moemesh.checkpoint.convert import load_model
from moemesh.checkpoint.dcp import TOKENIZER_FILE
from moemesh.data.tokenizer import Tokenizer, load_tokenizer
from moemesh.errors import RequestError
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams, Sequence
from moemesh.inference.scheduler import Scheduler
from moemesh.models import MoECausalLM


def load_for_generation(path: str | os.PathLike, tokenizer: str | None = None, device: str = "cpu",
                        dtype: torch.dtype | None = None) -> tuple[MoECausalLM, Tokenizer]:
    """A model from a checkpoint, run directory or Hugging Face directory, in `dtype` (default
    bfloat16 on a GPU, float32 on a CPU), with its tokenizer: the one named, else the
    directory's tokenizer.json, else bytes."""
    model, source = load_model(path, device=device)
    model.to(dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32))
    model.eval()
    if tokenizer is None:
        tokenizer = str(source / TOKENIZER_FILE) if (Path(source) / TOKENIZER_FILE).is_file() else "bytes"
    return model, load_tokenizer(tokenizer)


def prompt_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The token ids of a prompt, after the end-of-document token."""
    ids = ([] if tokenizer.eos_id is None else [tokenizer.eos_id]) + tokenizer.encode(prompt)
    if not ids:
        raise RequestError("the prompt is empty and the tokenizer has no end-of-document token to start from", "prompt")
    return ids


def generate(engine: DecodeEngine, tokenizer: Tokenizer, prompts: Seq[str | list[int]],
             params: SamplingParams | Seq[SamplingParams] = SamplingParams()) -> list[Sequence]:
    """Every prompt (text, or token ids taken as they are) continued, in the order given; one
    SamplingParams for all or one per prompt. Each result has `text`, `token_ids` and
    `finish_reason` ("stop": the end-of-document token or a stop string, "length")."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    scheduler = Scheduler(engine, tokenizer, max_waiting=len(prompts))
    sequences = [scheduler.submit(p if isinstance(p, list) else prompt_ids(tokenizer, p), q)
                 for p, q in zip(prompts, params, strict=True)]
    scheduler.run_until_idle()
    return sequences
