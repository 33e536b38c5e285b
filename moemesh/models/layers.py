"""The dense building blocks: RMSNorm, rotary application, grouped-query attention, the gated MLP.
Numerics follow Hugging Face `transformers` so that logits match it to float32 rounding. With a
paged KV cache (kv_cache.py) attention writes the step's keys and values into it and reads each
token's sequence through its block table instead (`paged_attention`, the reference of the
kernels in ops/decode_attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.models.adapted import projections
from moemesh.models.config import ModelConfig
from moemesh.models.kv_cache import PagedKVCache
from moemesh.ops import decode_attention, documents, gemv, invariant, summed_norm
from moemesh.ops.backend import use_triton
from moemesh.ops.linear import Linear
from moemesh.ops.rms_norm import rms_norm
from moemesh.ops.rotary import rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32, cast back before the scale, as transformers does (ops/rms_norm.py).
        return rms_norm(x, self.weight, self.eps)

    def after_add(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, the norm of that) in one kernel where it can (`ops/rms_norm.add_rms_norm`);
        a delta that tensor parallelism left partial summed over the ranks first, in the same
        kernel where they map a buffer for it (`ops/summed_norm.py`)."""
        return summed_norm.add_summed_rms_norm(h, delta, self.weight, self.eps)


def attention_mask(q_positions: torch.Tensor, kv_len: int, sliding_window: int | None) -> torch.Tensor:
    """Boolean [..., Tq, Tk] mask for query positions [..., Tq] against keys at 0..kv_len-1, True
    where the query may attend the key (causal, optionally banded)."""
    k_positions = torch.arange(kv_len, device=q_positions.device)
    allowed = k_positions <= q_positions[..., None]
    if sliding_window is not None:
        allowed &= k_positions > q_positions[..., None] - sliding_window
    return allowed


class Attention(nn.Module):
    """Grouped-query attention with RoPE and, for Qwen3, an RMSNorm on every query and key head;
    for GPT-OSS, attention sinks and a sliding window on the layers `layer_types` marks."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.attention_head_dim
        self.sliding_window = config.layer_sliding_window(layer_idx)
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # One learned logit per head, competing with the keys in the softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: PagedKVCache | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        if invariant.on():
            return self.invariant(x, rope, positions, cache)
        if (
            cache is not None
            and use_triton(x)
            and decode_attention.fits(self.head_dim, rope[0].shape[-1])
            and getattr(self.q_proj, "lora_A", None) is None  # the kernels read the base weights (merge adapters first)
        ):
            return self.fused(x, rope, cache)
        q, k, v = (p.view(batch, seq, -1, self.head_dim) for p in projections(x, self.q_proj, self.k_proj, self.v_proj))
        v = v.transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = rotary(q.transpose(1, 2), cos, sin)
        k = rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:
            out = paged_attention(q, k, v, cache, self.layer_idx, self.head_dim**-0.5, self.sliding_window, self.sinks)
        elif self.sinks is not None:  # scaled_dot_product_attention takes no sinks
            mask = (
                attention_mask(positions, seq, self.sliding_window)
                if positions.dim() == 1
                else documents.document_mask(positions, self.sliding_window)
            )
            out = grouped_attention(q, k, v, mask, self.head_dim**-0.5, self.sinks)
        elif positions.dim() == 2:  # packed rows, each attending within itself (ops/documents.py)
            window = self.sliding_window if self.sliding_window is not None and seq > self.sliding_window else None
            out = documents.attention(q, k, v, positions, window=window)
        else:
            plain_causal = self.sliding_window is None or seq <= self.sliding_window
            mask = None if plain_causal else attention_mask(positions, seq, self.sliding_window)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=plain_causal, enable_gqa=self.num_kv_heads != self.num_heads
            )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))

    def invariant(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        positions: torch.Tensor,
        cache: PagedKVCache | None,
    ) -> torch.Tensor:
        """The forward in batch-invariant mode (`ops/invariant.py`): each query attends, alone, to
        exactly its keys — without a cache the sequence's up to its place (positions 0, 1, ... of
        each row, or of each packed row: the model's forward checks a caller's), with one
        those its table row holds up to its position. On the kernels' device (CUDA) by one
        attention kernel in both cases, else a loop over the queries (the CPU reference)."""
        if self.sinks is not None or self.sliding_window is not None:
            raise ValueError("batch-invariant mode does not cover attention sinks or sliding windows yet")
        batch, seq, _ = x.shape
        q, k, v = (p.view(batch, seq, -1, self.head_dim) for p in projections(x, self.q_proj, self.k_proj, self.v_proj))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = rotary(q.transpose(1, 2), cos, sin).transpose(1, 2), rotary(k.transpose(1, 2), cos, sin).transpose(1, 2)
        scale = self.head_dim**-0.5
        rows = batch * seq
        if cache is not None:
            cache.write(self.layer_idx, k.reshape(rows, -1, self.head_dim), v.reshape(rows, -1, self.head_dim))
        packed = cache is None and positions.dim() == 2  # rows packed in a sequence (the forward's check)
        if invariant.kernels(x):  # one kernel for whole sequences and the engine's steps
            if packed:
                raise ValueError("batch-invariant mode's attention kernel does not cover packed rows yet")
            if cache is None:
                out = invariant.causal_attention(q, k, v, scale)
            else:
                starts, lengths, count, _ = cache.tiles(invariant.tile_tokens(q.shape[2] // k.shape[2]))
                out = invariant.paged_attention(
                    q.reshape(rows, -1, self.head_dim),
                    cache.keys[self.layer_idx],
                    cache.values[self.layer_idx],
                    cache.block_tables,
                    cache.block_size,
                    cache.token_rows,
                    cache.positions,
                    starts,
                    lengths,
                    count,
                    scale,
                )
            return self.o_proj(out.reshape(batch, seq, -1))
        if cache is None:  # [B, T, heads, D]; a packed row's queries attend from the row's start
            index = torch.arange(seq, device=positions.device)
            starts = (index - positions).expand(batch, seq).tolist() if packed else [[0] * seq] * batch
            out = [
                invariant.attend(q[b, t], k[b, s : t + 1].transpose(0, 1), v[b, s : t + 1].transpose(0, 1), scale)
                for b in range(batch)
                for t, s in zip(range(seq), starts[b])
            ]
        else:
            out = []
            for i, (row, position) in enumerate(zip(cache.token_rows.tolist(), cache.positions.tolist())):
                keys, values = cache.gather(self.layer_idx, row, position + 1)
                out.append(
                    invariant.attend(
                        q.view(rows, *q.shape[2:])[i], keys[0, :, : position + 1], values[0, :, : position + 1], scale
                    )
                )
        return self.o_proj(torch.stack(out).view(batch, seq, -1))

    def fused(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: PagedKVCache) -> torch.Tensor:
        """The step's tokens [B, T, H] through the kernels of ops/gemv.py (a few rows) and
        ops/decode_attention.py: the forward above in three or four launches and o_proj."""
        batch, seq, _ = x.shape
        rows, projections = x.reshape(batch * seq, -1), (self.q_proj, self.k_proj, self.v_proj)
        if gemv.fits(rows, *(p.weight for p in projections)):  # the three in one launch
            q, k, v = gemv.gemv(rows, [p.weight for p in projections])
            if self.q_proj.bias is not None:
                q, k, v = (out + p.bias for out, p in zip((q, k, v), projections))
        else:
            q, k, v = (proj(rows) for proj in projections)
        keys, values = cache.pools(self.layer_idx, k.view(batch * seq, -1, self.head_dim), self.head_dim)
        # The tiles before rope_to_cache (their kernels, at a step's first layer, not between it
        # and the attention kernel: see decode_attention.paged_attention's token_a_sequence).
        starts, lengths, count, per_tile = cache.tiles(decode_attention.tile_tokens(q.shape[1] // k.shape[1]))
        cos, sin = (torch.broadcast_to(t, (batch, seq, self.head_dim)).reshape(-1, self.head_dim) for t in rope)
        norms = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        eps = self.q_norm.eps if self.q_norm is not None else 0.0
        q = decode_attention.rope_to_cache(q, k, v, cos, sin, *norms, eps, keys, values, cache.slots)
        out = decode_attention.paged_attention(
            q,
            keys,
            values,
            cache.block_tables,
            cache.block_size,
            cache.token_rows,
            cache.positions,
            starts,
            lengths,
            count,
            per_tile,
            cache.kv_len,
            self.head_dim**-0.5,
            self.sliding_window,
            token_a_sequence=not cache.packed,
            sinks=self.sinks,
        )
        return self.o_proj(out.view(batch, seq, -1))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    cache: PagedKVCache,
    layer_idx: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    value_dim: int | None = None,
) -> torch.Tensor:
    """Attention of the step's queries q [B, h, T, D] over the cache, after writing the step's
    keys k [B, h_kv, T, D] and values v [B, h_kv, T, Dv] into it: each token's queries against its
    sequence's keys up to its position (cache.set_step laid the tokens out) -> [B, h, T, Dv].
    With v None the values are the keys' first value_dim dims (DeepSeek's latent). Eager: the
    keys gathered through the block table, then `grouped_attention` with the causal mask."""
    batch, heads, seq, _ = q.shape

    def by_token(t: torch.Tensor) -> torch.Tensor:  # [B, heads, T, D] -> [B·T, heads, D]
        return t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1])

    cache.write(layer_idx, by_token(k), None if v is None else by_token(v))
    queries = by_token(q)

    def attend(q_rows: torch.Tensor, rows, entries: int, positions: torch.Tensor) -> torch.Tensor:
        keys, values = cache.gather(layer_idx, rows, entries)
        if values is None:
            values = keys[..., :value_dim]
        mask = attention_mask(positions, keys.shape[2], window)
        return grouped_attention(q_rows, keys, values, mask, scale, sinks)

    if cache.segments is None:  # a decode step: every token alone in its row
        out = attend(queries[:, :, None], cache.token_rows, cache.kv_len, cache.positions[:, None])[:, :, 0]
    else:
        out = torch.cat(
            [
                attend(
                    queries[first : first + count].transpose(0, 1)[None],
                    row,
                    entries,
                    cache.positions[first : first + count],
                )[0].transpose(0, 1)
                for row, first, count, entries in cache.segments
            ]
        )
    return out.view(batch, seq, heads, -1).transpose(1, 2)


# The most fp32 scores `grouped_attention` holds at once (256 MiB; a softmax's few copies of them
# beside): the eager attention's queries go in chunks beyond it.
SCORES_AT_ONCE = 2**26


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q·k · scale, masked) · v, computed explicitly, for q [B, h, T, D] against k
    [B, h_kv, L, D] and v [B, h_kv, L, Dv] (a KV cache's), mask [T, L] or [B, T, L] (True: visible).
    The h / h_kv query heads that share a key/value head are multiplied as one matrix, so each cached entry is read once
    (no repeated keys). With `sinks` (GPT-OSS: one logit per head), each head's softmax has one
    more column that takes probability and returns nothing. Scores and softmax in fp32, for at
    most SCORES_AT_ONCE scores at a time: longer queries go in chunks (a 32k-token prompt's
    scores over its keys, at GPT-OSS's 64 heads, would be 256 GiB at once)."""
    batch, heads, seq, _ = q.shape
    kv_heads, kv_len = k.shape[1], k.shape[2]
    chunk = max(1, SCORES_AT_ONCE // (batch * heads * kv_len))
    if seq > chunk:
        return torch.cat(
            [
                grouped_attention(q[:, :, at : at + chunk], k, v, mask[..., at : at + chunk, :], scale, sinks)
                for at in range(0, seq, chunk)
            ],
            dim=2,
        )
    groups = heads // kv_heads
    scores = (q.reshape(batch, kv_heads, groups * seq, -1) @ k.transpose(-2, -1)).float() * scale
    scores = scores.view(batch, kv_heads, groups, seq, kv_len)
    mask = mask.view(-1, 1, 1, seq, kv_len)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, kv_heads, groups, 1, 1).expand(batch, -1, -1, seq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = probs.to(v.dtype).view(batch, kv_heads, groups * seq, kv_len) @ v
    return out.view(batch, heads, seq, -1)


# hidden_act -> the gate's activation, as transformers' ACT2FN computes it.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DenseMLP(nn.Module):
    """Gated feed-forward (SwiGLU, or GeGLU for Gemma) of the dense (non-MoE) layers."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = projections(x, self.gate_proj, self.up_proj)
        return self.down_proj(self.act(gate) * up)
