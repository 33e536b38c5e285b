"""Batch-invariant arithmetic (issue 50): while `batch_invariant()` is on, every row a model
computes — a token's projections, its attention, its experts, its logits — gets the same bits
whatever else is computed with it. The engine's tokens and log-probabilities then do not depend
on the step's other sequences, on where chunked prefill split a prompt, on prefix reuse or on
preemption; and the trainer's forward of a whole sequence gives each token's log-probability
bit-equal to the engine's, which sampled it one step at a time (reinforcement learning's
importance ratio is then exactly 1 where the weights are the same).

Why the default path is not: a GEMM's kernel, and with it the order in which a row's products
are added, depends on how many rows it computes (on a CPU torch's fp32 `F.linear` of 1 to 8 rows
differs from the same rows among 64); decoding attends over a padded window with a mask and
prefill over a whole chunk; the MoE takes a per-token path for few tokens and grouped GEMMs for
many. Here instead:

  * `linear`: rows in tiles of TILE (the last padded), one GEMM call a tile, so each row is
    computed by a call of the same shape wherever it sits (checked: a row's bits do not depend
    on its place in a tile or on the other rows, fp32 and bf16);
  * `attend`: one query at a time over exactly its keys — scores summed over the head dimension,
    a softmax over those keys alone, the values summed in key order — in fp32;
  * `experts`: each (token, expert) pair through the expert's two `linear`s, after the block's own
    dispatch (a copy of each row, in any layout), the k outputs then summed with the routing
    weights in slot order by its combine.

Every other op of the models (norms, rotary, softmax and top-k of the router, sampling) is already
per row. The price: a Python loop per query and per expert — a reference mode, exact and tested
on CPUs (fp32 and bf16; tests/test_batch_invariant.py), 7× the default's time for a GRPO step of
the tiny model (examples/grpo.py), far more for a large one. GPU kernels with the same property
(a fixed-tile GEMM without split-K, one attention kernel with a fixed split, one MoE path) are not
written yet. Not covered:
attention sinks and sliding windows, latent attention, LoRA adapters (merge them first). Under
tensor parallelism, and expert parallelism for decoding, the engine and the trainer agree bit for
bit on two ranks (a sum of two partials has one order); over more ranks the all-reduces' order may
depend on their size.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

TILE = 16  # rows a GEMM call computes, whatever the batch
_on = False


def on() -> bool:
    return _on


@contextlib.contextmanager
def batch_invariant(enabled: bool = True):
    """Compute in batch-invariant mode inside (process-wide, not thread-safe); `enabled=False`
    leaves the mode as it is."""
    global _on
    before, _on = _on, _on or enabled
    try:
        yield
    finally:
        _on = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), each row computed in a tile of TILE rows."""
    rows = x.reshape(-1, x.shape[-1])
    padded = F.pad(rows, (0, 0, 0, (-rows.shape[0]) % TILE))
    out = torch.cat([F.linear(tile, weight.to(x.dtype)) for tile in padded.split(TILE)])[: rows.shape[0]]
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query's attention: q [h, D] over its keys k [h_kv, n, D] and values v [h_kv, n, Dv]
    (the h / h_kv query heads of a group share a key/value head) -> [h, Dv] in q's dtype."""
    groups = q.shape[0] // k.shape[0]
    keys, values = k.float().repeat_interleave(groups, 0), v.float().repeat_interleave(groups, 0)
    scores = (q.float()[:, None, :] * keys).sum(-1) * scale  # [h, n]
    probs = torch.softmax(scores, dim=-1)
    return (probs[..., None] * values).sum(1).to(q.dtype)


def experts(
    grouped: torch.Tensor,
    group_sizes: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows of a dispatch, grouped [N, H] sorted by expert in groups of group_sizes [E] (banks
    gate_up [E, 2I, H], down [E, H, I]), each through its expert's two `linear`s -> [N, H]; rows
    past the last group (served elsewhere) are zeros. Differentiable."""
    pieces, start = [], 0
    for expert, size in enumerate(group_sizes.tolist()):
        rows = grouped[start : start + size]
        h = linear(rows, gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert])
        pieces.append(linear(activation(h), down[expert], None if down_bias is None else down_bias[expert]))
        start += size
    return torch.cat([*pieces, grouped.new_zeros(grouped.shape[0] - start, grouped.shape[1])])
