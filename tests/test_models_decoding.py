"""Decoding with the static KV cache, every family: rows prefilled alone at different lengths,
then decoded together one token a step, each at its own position, give the logits of the full
forward (the training path, no cache) at every position.

fp32 on CPU, tolerance 1e-5 relative: the cached path computes attention explicitly over the
cache (fp32 scores and softmax) where the full forward calls scaled_dot_product_attention, the
same sums in another order (~1e-7); a key at the wrong position, a row reading another row's
cache or a window off by one moves logits by far more."""

import pytest
import torch

from moemesh.models import KVCache, ModelConfig, build
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


def decode_stepwise(model, input_ids: torch.Tensor, prefill: list[int]) -> torch.Tensor:
    """Logits [B, S, V]: row b's first prefill[b] tokens in one forward into cache row b alone,
    then the rest one token a step, all rows in one batch at their own positions (a row that is
    done repeats its last token, rewriting the same cache entry)."""
    batch, seq = input_ids.shape
    cache = KVCache(rows=batch + 1, max_len=seq + 3)  # a spare row, a longer buffer: only kv_len is read
    logits = [[] for _ in range(batch)]
    for b, n in enumerate(prefill):
        cache.row_start, cache.kv_len = b, n
        logits[b].append(model(input_ids[b : b + 1, :n], cache=cache).logits[0])
    cache.row_start = 0
    for step in range(seq - min(prefill)):
        positions = torch.tensor([min(n + step, seq - 1) for n in prefill])
        cache.kv_len = int(positions.max()) + 1
        out = model(input_ids.gather(1, positions[:, None]), cache=cache, positions=positions[:, None]).logits
        for b, n in enumerate(prefill):
            if n + step < seq:
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


def test_the_cache_refuses_rows_or_entries_it_does_not_have():
    model = build(FAMILIES["qwen3_moe"], seed=1).eval()
    cache = KVCache(rows=2, max_len=8)
    cache.row_start = 1
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match=r"rows \[1, 3\) x 8 entries do not fit a cache of 2 rows x 8"),
    ):
        model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
