"""The trainer's log-probabilities of sampled tokens, for reinforcement learning (GRPO, PPO).

Why: an RL step samples completions with the inference engine, which returns each sampled
token's log-probability (`SamplingParams.logprobs`: processing.py), and then trains on them with
the trainer's forward. The importance ratio exp(trainer − sampler) is only right if the two
forwards compute the same numbers — the same logits, and in an MoE the same experts per token:
a router that flips on a near-tie changes a token's whole path. `completion_logprobs` gives the
trainer's side of that comparison, and of the loss: each completion token's log-probability from
the training forward, with autograd, and optionally the experts every MoE layer chose per token
(`models.moe.RoutingRecorder`), to count against those the engine recorded (the scheduler's
`record_routing`).

What it computes: `MoECausalLM.forward` without a cache — the training step's layers and kernels
(grouped GEMMs, full attention) — over each prompt + completion, right-padded into one batch
[B, T] (causal attention: the padding after a sequence changes nothing before it); the logits in
fp32 divided by the sampling temperature, log_softmax, and the entry of each completion token at
the position before it. The training step's own loss (the fused linear cross-entropy) never holds
these logits; here they are materialised, [B, T, V] fp32, since per-token values are wanted.

What matches the engine, measured on CPU in fp32 (tests/test_train_logprobs.py): the engine's
log-probabilities to ~1e-6 and every routing decision — not bit for bit: the engine's decoding
kernels (paged attention, the few-token expert path) sum in other orders. With `batch_invariant`
(and an engine made with it: ops/invariant.py) bit for bit, fp32 and bf16
(tests/test_batch_invariant.py).

Under tensor parallelism the head holds this rank's vocabulary slice: each token's log-probability
is then reduced over the group without gathering the logits (`tensor.vocab_parallel_logprobs`),
and every rank of the group must score the same sequences (the forward's collectives pair up).

Limits: the engine's temperature is reproduced, not its top_p < 1 (tokens outside the nucleus
at -inf), penalties, biases or grammars; run it under the trainer's autocast for a
mixed-precision step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moemesh.models import MoECausalLM
from moemesh.models.moe import RoutingRecorder
from moemesh.ops import invariant


@dataclass
class Scored:
    logprobs: list[torch.Tensor]  # per sequence: [completion tokens] fp32, with autograd
    # per sequence: [prompt + completion tokens, MoE layers, k], the experts chosen at each
    # position (sorted ascending); None unless asked for
    routing: list[torch.Tensor] | None = None


def completion_logprobs(
    model: MoECausalLM,
    prompts: list[list[int]],
    completions: list[list[int]],
    temperature: float = 1.0,
    routing: bool = False,
    batch_invariant: bool = False,
) -> Scored:
    """Each completion token's log-probability under `model`'s training forward, at `temperature`
    (as the engine samples; 0 — greedy — reads as 1, as the engine reports greedy tokens'), and
    with `routing` the experts chosen for every token. `batch_invariant`: the forward in that mode
    (ops/invariant.py), bit-equal to an engine's made with `batch_invariant=True`."""
    if len(prompts) != len(completions) or not prompts:
        raise ValueError(
            f"need as many prompts as completions, at least one; got {len(prompts)} and {len(completions)}"
        )
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token (the first completion token's logits come from it)")
    sequences = [p + c for p, c in zip(prompts, completions)]
    length = max(len(s) for s in sequences)
    device = next(model.parameters()).device
    tokens = torch.zeros(len(sequences), length, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        tokens[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    recorder = RoutingRecorder(model)
    if routing:
        recorder.start()
    try:
        with invariant.batch_invariant(batch_invariant):
            logits = model(tokens, output_router_logits=False).logits
        chosen = recorder.take() if routing else None
    finally:
        if routing:
            recorder.stop()
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        positions = torch.arange(len(p) - 1, len(p) + len(c) - 1, device=device)
        scaled, targets = logits[i, positions].float() / (temperature or 1.0), tokens[i, positions + 1]
        if model.vocab_parallel_loss is not None and not batch_invariant:  # TP: this rank's vocabulary slice
            out.append(model.vocab_parallel_logprobs(scaled, targets))
        elif model.vocab_parallel_loss is not None:  # the whole vocabulary, as the engine samples from
            out.append(F.log_softmax(model.gather_logits(scaled), dim=-1).gather(1, targets[:, None]).squeeze(1))
        else:
            out.append(F.log_softmax(scaled, dim=-1).gather(1, targets[:, None]).squeeze(1))
    if chosen is not None:
        chosen = chosen.view(len(sequences), length, *chosen.shape[1:])
        chosen = [chosen[i, : len(s)] for i, s in enumerate(sequences)]
    return Scored(out, chosen)
