"""Logits processing for requests that ask for more than temperature and top-p: penalties,
logit_bias, a grammar's mask (grammar.py) and log-probabilities, one row at a time on the host's
loop, after the engine's step (whose own draw the other rows keep, untouched).

The order is vLLM's: `logit_bias` added; the repetition penalty (Hugging Face's: the logit of
every token of the prompt or generated so far divided by it when positive, multiplied when
negative); the frequency and presence penalties (OpenAI's: logit - count * frequency_penalty -
[count > 0] * presence_penalty, counting the generated tokens); the grammar's mask (tokens it
forbids at -inf). Then temperature and top-p (`sampling.distribution`) and the draw: the engine's
own (`sampling.sample`, the request's seed and step), so a request whose processing changes no
logit gets the very token it would get without it.

Log-probabilities are those of the distribution the token was drawn from: log_softmax of the
processed logits divided by the temperature, the tokens outside top-p's nucleus at -inf (sent as
-9999.0, as vLLM does, since JSON has no infinity). A greedy request (temperature 0) takes the
argmax of the processed logits: its log-probabilities are theirs at temperature 1.
"""

from __future__ import annotations

import torch

from moemesh.errors import RequestError
from moemesh.inference.request import Logprob, SamplingParams
from moemesh.inference.sampling import distribution, mode_for, sample, token_logprobs

FLOOR = -9999.0  # a log-probability of -inf, as JSON can carry it


class RowSampler:
    """One request's processing state: its generated tokens' counts, the tokens it has seen,
    its bias and its grammar's matcher (an llguidance LLMatcher), on the logits' device."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab: int,
        device: torch.device,
        matcher=None,
        stop_ids: frozenset[int] = frozenset(),
    ):
        self.params, self.matcher, self.stop_ids = params, matcher, stop_ids
        self.counts = self.seen = self.bias = None
        if params.presence_penalty or params.frequency_penalty:
            self.counts = torch.zeros(vocab, device=device)
        if params.repetition_penalty != 1:
            self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt_ids, dtype=torch.long, device=device)] = True
        if params.logit_bias:
            ids, values = zip(*params.logit_bias)
            self.bias = torch.zeros(vocab, device=device)
            self.bias[torch.tensor(ids, dtype=torch.long, device=device)] = torch.tensor(
                values, dtype=torch.float32, device=device
            )
        self.changes_logits = any(x is not None for x in (self.counts, self.seen, self.bias, matcher))
        sampling = params.sampling
        self.greedy = sampling.temperature == 0
        self.temperature = torch.tensor([sampling.temperature], device=device)
        self.top_p = torch.tensor([sampling.top_p], device=device)
        self.seed = torch.tensor([sampling.seed], device=device)
        self.mode = mode_for([sampling.temperature], [sampling.top_p])

    def choose(self, logits: torch.Tensor, drawn: int, step: int) -> tuple[int, Logprob | None]:
        """logits [V]: the row's raw logits; drawn: the engine's token from them; step: the tokens
        sampled so far. -> (the token, its Logprob when asked)."""
        x = logits.float()[None]
        if self.changes_logits:
            x = self.process(x)
            steps = torch.tensor([step], device=x.device)
            drawn = int(sample(x, self.temperature, self.top_p, self.seed, steps, self.mode)[0])
        logprob = None if self.params.logprobs is None else self.logprob(x, drawn)
        self.accept(drawn)
        return drawn, logprob

    def process(self, x: torch.Tensor) -> torch.Tensor:
        """[1, V] fp32 logits -> processed (a new tensor)."""
        x = x.clone()
        if self.bias is not None:
            x += self.bias
        if self.seen is not None:
            penalty = self.params.repetition_penalty
            x = torch.where(self.seen, torch.where(x > 0, x / penalty, x * penalty), x)
        if self.counts is not None:
            x -= self.counts * self.params.frequency_penalty + (self.counts > 0) * self.params.presence_penalty
        if self.matcher is not None:
            allowed = self.matcher.compute_logit_bias()
            if self.matcher.is_error():
                raise RequestError(f"response_format: the grammar failed: {self.matcher.get_error()}")
            mask = torch.zeros(x.shape[-1], dtype=torch.bool)
            mask[: len(allowed)] = torch.frombuffer(bytearray(allowed), dtype=torch.uint8)[: x.shape[-1]] != 0
            x = x.masked_fill(~mask.to(x.device), float("-inf"))
        return x

    def logprob(self, x: torch.Tensor, token: int) -> Logprob:
        """The token's Logprob under the distribution drawn from (greedy: at temperature 1)."""
        if self.greedy:
            scaled = x
        else:
            scaled = distribution(x, self.temperature, self.top_p, self.mode == "nucleus")
        chosen, ids, top = token_logprobs(scaled, torch.tensor([token], device=x.device), self.params.logprobs)
        return Logprob(
            max(float(chosen[0]), FLOOR),
            tuple((i, max(v, FLOOR)) for i, v in zip(ids[0].tolist(), top[0].tolist())),
        )

    def accept(self, token: int) -> None:
        if token in self.stop_ids:
            return
        if self.counts is not None:
            self.counts[token] += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.matcher is not None and not self.matcher.consume_token(token):
            raise RequestError(f"response_format: the grammar refused token {token}: {self.matcher.get_error()}")
