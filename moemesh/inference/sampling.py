"""The next token of every row, chosen on the device: greedy, temperature, nucleus (top-p), each
row with its own settings and seed, with no host synchronisation (the caller reads the chosen
tokens, once per step).

Randomness is a counter-based hash of (seed, step, token id) rather than a torch.Generator: a
request's tokens then depend on its seed and its own step count alone — not on which requests
share its batch, or on which rank of a tensor-parallel group samples — and the whole draw is
plain tensor arithmetic that a CUDA graph can capture. The draw is the Gumbel-max trick:
argmax(logits / temperature + Gumbel noise) is a sample of softmax(logits / temperature); top-p
first removes the tokens outside the smallest set whose probability reaches p.
`distribution` is that softmax's input, which processing.py also reads log-probabilities from.

`mode` says what the batch needs, so that a greedy batch pays for no noise and a batch without
top-p for no sort of the vocabulary: "greedy", "sample" or "nucleus".
"""

from __future__ import annotations

import torch

MODES = ("greedy", "sample", "nucleus")
_MASK32 = 0xFFFFFFFF


def mode_for(temperatures: list[float], top_ps: list[float]) -> str:
    """The cheapest mode that serves rows with these settings."""
    sampled = [p for t, p in zip(temperatures, top_ps) if t > 0]
    if not sampled:
        return "greedy"
    return "nucleus" if any(p < 1 for p in sampled) else "sample"


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    mode: str,
) -> torch.Tensor:
    """logits [B, V]; temperature, top_p [B] float; seed, step [B] int64 -> token ids [B] int64.
    Rows at temperature 0 take the argmax whatever the mode."""
    greedy = logits.argmax(dim=-1)
    if mode == "greedy":
        return greedy
    scaled = distribution(logits, temperature, top_p, mode == "nucleus")
    drawn = (scaled + gumbel_noise(seed, step, logits.shape[-1])).argmax(dim=-1)
    return torch.where(temperature > 0, drawn, greedy)


def distribution(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, nucleus: bool) -> torch.Tensor:
    """The logits [B, V] that a draw takes the softmax of: divided by the temperature (fp32), and
    with `nucleus` those outside each row's top-p nucleus at -inf."""
    scaled = logits.float() / temperature.clamp_min(1e-6)[:, None]
    if nucleus:
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Outside: the mass before the token already reaches top_p (the most likely token stays).
        outside_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p[:, None]) & (top_p[:, None] < 1)
        outside = torch.empty_like(outside_sorted).scatter_(1, order, outside_sorted)
        scaled = scaled.masked_fill(outside, float("-inf"))
    return scaled


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] standard Gumbel noise, a function of (seed, step, token id) alone. A seed's high
    32 bits are hashed into its low ones (a no-op for seeds below 2**32: the hash of 0 is 0)."""
    token = torch.arange(vocab, device=seed.device)
    row = _mix32(_mix32((seed & _MASK32) ^ _mix32((seed >> 32) & _MASK32)) ^ (step & _MASK32))
    bits = _mix32(row[:, None] ^ token)
    uniform = ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 random bits, strictly inside (0, 1)
    return -torch.log(-torch.log(uniform))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Mueller's) in int64 arithmetic: products stay below 2**59."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, V] (fp32 after processing), targets [T] -> (each target's log-probability [T],
    the k likeliest tokens [T, k] and their log-probabilities [T, k]) under softmax(logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])[:, 0]
    top, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
    return chosen, ids, top
