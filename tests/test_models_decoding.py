"""Decoding with the paged KV cache, every family: rows' prompts prefilled in chunks, several
rows' chunks packed into one forward beside other rows' single decode tokens, then decoded
together one token a step, each at its own position, give the logits of the full forward (the
training path, no cache) at every position. The rows own shuffled blocks (random block tables)
of 4 entries, so that sequences cross block edges at odd places and their last blocks are partial.

fp32 on CPU, tolerance 1e-5 relative: the cached path computes attention explicitly over the
cache (fp32 scores and softmax) where the full forward calls scaled_dot_product_attention, the
same sums in another order (~1e-7); a key at the wrong position, a row reading another row's
blocks or a window off by one moves logits by far more."""

import math

import pytest
import torch

from moemesh.models import ModelConfig, PagedKVCache, build
from numerics import rel_err
from test_parallel_families import CONFIGS
from tiny_run import TINY_MODEL

RTOL = 1e-5
FAMILIES = {
    **CONFIGS,
    "qwen3_moe": ModelConfig(**TINY_MODEL, qk_norm=True, sliding_window=5, initializer_range=0.2),
    "mixtral": ModelConfig(**{**TINY_MODEL, "model_type": "mixtral"}, initializer_range=0.2),
    # the full layers' values are their keys (no v_proj), with their own heads and head size
    "gemma4_k_eq_v": CONFIGS["gemma4"].replace(attention_k_eq_v=True, num_global_key_value_heads=2),
}


def paged_cache(rows: int, max_len: int, block_size: int = 4, spare: int = 3, seed: int = 0) -> PagedKVCache:
    """A cache whose rows own shuffled blocks (random block tables), with spare blocks unused."""
    per_row = math.ceil(max_len / block_size)
    cache = PagedKVCache(1 + rows * per_row + spare, block_size, rows, max_len)
    order = torch.randperm(cache.num_blocks - 1, generator=torch.Generator().manual_seed(seed), device="cpu") + 1
    cache.block_tables[:rows] = order[: rows * per_row].view(rows, per_row).to(torch.int32)
    return cache


def decode_stepwise(model, input_ids: torch.Tensor, prefill: list[int], chunk: int = 3) -> torch.Tensor:
    """Logits [B, S, V]. Rounds of one forward each: a row still in its first prefill[b] tokens
    brings its next `chunk` of them (no further than prefill[b]), a row past them its next token,
    all packed into one sequence of segments; once every row is past its prefill, the rest one
    token a step, all rows in a decode-shaped batch [B, 1] at their own positions (a row that is
    done repeats its last token, rewriting the same cache entry)."""
    batch, seq = input_ids.shape
    device = input_ids.device
    cache = paged_cache(batch, seq + 3)  # longer rows than needed: only the positions in use are read
    cache.block_tables = cache.block_tables.to(device)
    logits = [[] for _ in range(batch)]
    done = [0] * batch
    while any(d < p for d, p in zip(done, prefill)):
        tokens, rows, positions, segments = [], [], [], []
        for b in range(batch):
            if done[b] >= seq:
                continue
            n = min(chunk, prefill[b] - done[b]) if done[b] < prefill[b] else 1
            segments.append((batch - 1 - b, len(tokens), n, done[b] + n))  # row b's sequence in table row B-1-b
            tokens += input_ids[b, done[b] : done[b] + n].tolist()
            rows += [batch - 1 - b] * n
            positions += range(done[b], done[b] + n)
        at = torch.tensor(positions, device=device)
        cache.set_step(torch.tensor(rows, device=device), at, max(s[3] for s in segments), segments)
        out = model(torch.tensor([tokens], device=device), cache=cache, positions=at[None]).logits[0]
        for row, first, n, _ in segments:
            logits[batch - 1 - row].append(out[first : first + n])
            done[batch - 1 - row] += n
    for step in range(seq - min(done)):
        positions = torch.tensor([min(d + step, seq - 1) for d in done], device=device)
        cache.set_step(torch.arange(batch - 1, -1, -1, device=device), positions, int(positions.max()) + 1)
        out = model(input_ids.gather(1, positions[:, None]), cache=cache, positions=positions[:, None]).logits
        for b, d in enumerate(done):
            if d + step < seq:
                logits[b].append(out[b])
    return torch.stack([torch.cat(rows) for rows in logits])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cached_decoding_of_rows_at_different_positions_equals_the_full_forward(family):
    config = FAMILIES[family]
    model = build(config, seed=1).eval()
    input_ids = torch.randint(0, config.vocab_size, (3, 11))
    with torch.no_grad():
        full = model(input_ids).logits
        stepwise = decode_stepwise(model, input_ids, prefill=[4, 1, 7])
    assert rel_err(stepwise, full) <= RTOL, family


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_the_residual_adds_fused_into_the_norms_change_no_bit(family, kernels, monkeypatch):
    """DecoderLayer.infer (the engine's layers: each residual add inside the norm after it, the
    last left to the next layer) against the layers' forward, bit for bit: the same roundings in
    the same order (deepseek_v3: a dense first layer before the MoE ones). "triton": the kernels
    (Triton's interpreter on CPU), the fused add and norm among them."""
    from moemesh.models.transformer import DecoderLayer
    from moemesh.ops.backend import HAVE_TRITON, INTERPRETED

    if kernels == "triton" and not (HAVE_TRITON and (INTERPRETED or torch.cuda.is_available())):
        pytest.skip("the Triton kernels need a GPU or TRITON_INTERPRET=1")
    monkeypatch.setenv("MOEMESH_KERNELS", kernels)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    config = FAMILIES[family]
    model = build(config, seed=1, device=device).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 7), device=device)
    logits = {}
    for fused in (True, False):
        monkeypatch.setattr(DecoderLayer, "fuses_residual_adds", fused)
        with torch.no_grad():
            logits[fused] = decode_stepwise(model, input_ids, prefill=[3, 5])
    assert torch.equal(logits[True], logits[False])


def test_the_cache_refuses_entries_it_does_not_have():
    cache = PagedKVCache(num_blocks=5, block_size=4, rows=2, max_len=8)
    with pytest.raises(ValueError, match="9 entries do not fit a cache of rows of 8"):
        cache.set_step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 9)
    with pytest.raises(ValueError, match=r"a paged cache needs >= 2 blocks \(block 0 is the null block\)"):
        PagedKVCache(num_blocks=1, block_size=4, rows=2, max_len=8)
