"""Text generation with a KV cache: the prompt runs once, then each new token costs one position.
Greedy at temperature 0, otherwise temperature and nucleus (top-p) sampling."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moemesh.data.tokenizer import Tokenizer, load_tokenizer
from moemesh.errors import MoemeshError
from moemesh.models import KVCache, MoECausalLM
from moemesh.checkpoint.convert import load_model
from moemesh.checkpoint.dcp import TOKENIZER_FILE


def sample_next(logits: torch.Tensor, temperature: float, top_p: float,
                generator: torch.Generator | None = None) -> int:
    """One token id from the logits [V] of the last position."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
        outside = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: MoECausalLM, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """The new token ids that follow `prompt_ids` (at most max_new_tokens; stops at eos_id and at
    the model's max_position_embeddings)."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token")
    max_new_tokens = min(max_new_tokens, model.config.max_position_embeddings - len(prompt_ids))
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache()

    def next_logits(ids: list[int]) -> torch.Tensor:
        # Under tensor parallelism each rank holds a vocabulary slice: gathering the last position
        # gives every rank the same full logits, so each samples the same token from the same seed.
        return model.gather_logits(model(torch.tensor([ids], device=device), cache=cache).logits[:, -1])[0]

    logits = next_logits(prompt_ids)
    new_ids: list[int] = []
    while len(new_ids) < max_new_tokens:
        token = sample_next(logits, temperature, top_p, generator)
        if token == eos_id:
            break
        new_ids.append(token)
        if len(new_ids) < max_new_tokens:
            logits = next_logits([token])
    return new_ids


def load_for_generation(path: str | os.PathLike, tokenizer: str | None = None,
                        device: str = "cpu") -> tuple[MoECausalLM, Tokenizer]:
    """A model from a checkpoint, run directory or Hugging Face directory, with its tokenizer:
    the one named, else the directory's tokenizer.json, else bytes."""
    model, source = load_model(path, device=device)
    model.eval()
    if tokenizer is None:
        tokenizer = str(source / TOKENIZER_FILE) if (Path(source) / TOKENIZER_FILE).is_file() else "bytes"
    return model, load_tokenizer(tokenizer)


def complete(model: MoECausalLM, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> str:
    """The text generated after `prompt`. The prompt is preceded by the end-of-document token,
    as a document is in training, so that it reads as the start of a document."""
    start = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    prompt_ids = start + tokenizer.encode(prompt)
    if not prompt_ids:
        raise MoemeshError("the prompt is empty and the tokenizer has no end-of-document token to start from")
    if len(prompt_ids) >= model.config.max_position_embeddings:
        raise MoemeshError(f"the prompt is {len(prompt_ids)} tokens long, and the model takes at most "
                           f"max_position_embeddings = {model.config.max_position_embeddings} (new tokens included)")
    new_ids = generate(model, prompt_ids, max_new_tokens, temperature, top_p, tokenizer.eos_id, seed)
    return tokenizer.decode(new_ids)
