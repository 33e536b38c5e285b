"""The decoding kernels against their references: the router's fused top-k softmax, the few-row
GEMV and attention against the paged KV cache — each op alone, then whole models prefilling
packed chunks and decoding step by step with the kernels against the same model with the eager
path.

Triton runs compiled on a GPU, interpreted on a CPU. fp32 both sides, the same products summed
in another order: relative error <= 1e-6 for an op, <= 1e-5 for a model's logits (as the cached
path's own test). A wrong head, row, position, expert or weight is off by O(1). The bf16 cases
run on a GPU only: Triton's CPU interpreter computes `tl.dot` wrongly in bf16 (off by ~1e10,
measured with Triton 3.9) and truncates fp32 to bf16 where a GPU rounds to nearest (twice the
error), so there they say so and skip. bf16 tolerance: one or two roundings of the output
(relative 1e-2; attention 2e-2)."""

import pytest
import torch

from moemesh.models import build
from moemesh.models.layers import attention_mask, grouped_attention, rms_norm
from moemesh.ops import decode_attention, gemv
from moemesh.ops import topk_softmax as topk_softmax_module
from moemesh.ops.rotary import rotary
from moemesh.ops.topk_softmax import topk_softmax, topk_softmax_reference
from numerics import rel_err
from test_models_decoding import FAMILIES, decode_stepwise

DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="Triton's CPU interpreter computes tl.dot wrongly in bf16 and truncates fp32 to bf16",
        ),
    ),
]


def tol(dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("tokens, experts, k", [(1, 128, 8), (7, 60, 4), (3, 8, 8), (0, 16, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax(triton_kernels, tokens, experts, k, renormalize):
    logits = torch.randn(tokens, experts) * 3
    weights, ids = topk_softmax(logits, k, renormalize)
    expected_weights, expected_ids = topk_softmax_reference(logits, k, renormalize)
    assert ids.dtype == torch.long and weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)  # random logits: no ties, descending order as torch.topk
    assert tokens == 0 or rel_err(weights, expected_weights) <= 1e-6


@pytest.mark.parametrize("packed", [True, False])
def test_topk_softmax_picks_the_lowest_index_among_equal_probabilities(triton_kernels, monkeypatch, packed):
    """Logits of a few distinct values (many ties, one row all equal): the k largest probabilities
    in descending order, the lowest index first among equal ones (a stable descending sort), both
    ways of choosing (`PACKED_CHOICE`: one maximum of packed keys, or a maximum then an index)."""
    monkeypatch.setattr(topk_softmax_module, "PACKED_CHOICE", packed)
    logits = torch.randint(0, 4, (6, 128)).float()
    logits[0] = 1.0
    weights, ids = topk_softmax(logits, 8, False)
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    assert torch.equal(ids, order.indices[:, :8])
    assert rel_err(weights, probs.gather(1, ids)) <= 1e-6  # the kernel's softmax, not torch's: ulps apart


def test_topk_softmax_refuses_a_k_beyond_the_experts():
    with pytest.raises(ValueError, match=r"0 < k <= E, got \(2, 4\) and k=5"):
        topk_softmax(torch.randn(2, 4), 5, True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, most", [(1, 16), (5, 16), (16, 16), (40, 64)])  # 40: a tile of 64 rows
def test_gemv_of_up_to_three_weights(triton_kernels, monkeypatch, dtype, rows, most):
    monkeypatch.setattr(gemv, "MAX_ROWS", most)
    x = torch.randn(rows, 300).to(dtype)
    weights = [torch.randn(n, 300).to(dtype) for n in (70, 5, 33)]
    assert gemv.fits(x, *weights) is False  # gradients on: the autograd path
    with torch.no_grad():
        assert gemv.fits(x, *weights) and not gemv.fits(torch.randn(most + 1, 300).to(dtype), weights[0])
        for count in (1, 3):
            for out, w in zip(gemv.gemv(x, weights[:count]), weights):
                assert out.shape == (rows, w.shape[0]) and out.dtype == dtype
                assert rel_err(out, x.double() @ w.double().T) <= tol(dtype)


@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_of_every_tile_the_autotuner_may_pick(triton_kernels, monkeypatch, rows):
    """Each config of gemv.CONFIGS that the pruning leaves for these rows (blocks of fewer than 16
    outputs for one row alone: its reduction path), run as the kernel's tile, against fp64."""
    from moemesh.ops.backend import HAVE_TRITON, INTERPRETED, _FirstConfig

    if not (HAVE_TRITON and INTERPRETED):
        pytest.skip("on a GPU the autotuner runs every config at a shape's first launch (the test above)")
    kernel = gemv._gemv_kernel.kernel
    x = torch.randn(rows, 300)
    weights = [torch.randn(n, 300) for n in (70, 5, 33)]
    named = {"ROWS": 1 if rows == 1 else 16}
    kept = gemv._one_row_tiles(gemv.CONFIGS, named)
    narrow = [c for c in gemv.CONFIGS if c.kwargs["BLOCK_OUT"] < 16]
    assert narrow and (kept == gemv.CONFIGS if rows == 1 else kept == [c for c in gemv.CONFIGS if c not in narrow])
    for config in kept:
        monkeypatch.setattr(gemv, "_gemv_kernel", _FirstConfig(kernel, config))
        with torch.no_grad():
            for out, w in zip(gemv.gemv(x, weights), weights):
                assert rel_err(out, x.double() @ w.double().T) <= tol(torch.float32), config


@pytest.mark.parametrize("norm", [True, False])
def test_rope_to_cache_in_blocks_of_tokens_equals_a_program_a_token(triton_kernels, norm):
    """Steps of more than ROPE_SMALL_STEP tokens run rope_to_cache's programs on blocks of
    tokens (a partial last block here); the same tokens in two halves of a program a token each
    give the same q and cache, bit for bit (the same fp32 operations on each element). The
    per-token path is the one the paged attention test above checks against the reference."""
    tokens, heads, kv_heads, dim = decode_attention.ROPE_SMALL_STEP + 37, 4, 2, 16
    assert tokens % decode_attention.ROPE_TOKENS and tokens // 2 <= decode_attention.ROPE_SMALL_STEP
    q, k, v = (torch.randn(tokens, n * dim) for n in (heads, kv_heads, kv_heads))
    angles = torch.arange(tokens)[:, None].float() * torch.rand(dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    norms = (torch.rand(dim) + 0.5, torch.rand(dim) + 0.5) if norm else (None, None)
    slots = torch.randperm(tokens + 9)[:tokens]
    pools = [[torch.zeros(tokens + 9, kv_heads, dim) for _ in range(2)] for _ in range(2)]
    whole = decode_attention.rope_to_cache(q, k, v, cos, sin, *norms, 1e-6, *pools[0], slots)
    half = tokens // 2
    halves = [
        decode_attention.rope_to_cache(
            q[part], k[part], v[part], cos[part], sin[part], *norms, 1e-6, *pools[1], slots[part]
        )
        for part in (slice(0, half), slice(half, tokens))
    ]
    assert torch.equal(whole, torch.cat(halves))
    assert all(torch.equal(a, b) for a, b in zip(*pools))
    assert torch.count_nonzero(pools[0][1][slots]) == tokens * kv_heads * dim  # every value written


def test_split_count_fills_the_launch_and_no_more():
    """A decode step splits its keys until the launch has about SPLIT_PROGRAMS programs: 16 ways for
    one token of four key/value heads, 2 for 64 tokens, none for 256; never more than a split per
    SPLIT_BLOCKS blocks of keys (a short cache stays whole), at most MAX_SPLITS, a power of two."""
    count = decode_attention.split_count
    assert [count(1024, tokens * 4, 32) for tokens in (1, 16, 64, 256)] == [16, 8, 2, 1]
    assert count(63, 4, 32) == 1 and count(200, 4, 32) == 2  # 3 pairs of blocks of 32
    assert count(1 << 20, 1, 32) == decode_attention.MAX_SPLITS
    for kv_len in (1, 64, 100, 1000, 40960):
        for programs in (1, 3, 64, 300, 5000):
            n = count(kv_len, programs, 64)
            assert 1 <= n <= decode_attention.MAX_SPLITS and n & (n - 1) == 0
            assert n == 1 or (
                n * programs <= decode_attention.SPLIT_PROGRAMS and n * decode_attention.SPLIT_BLOCKS * 64 <= kv_len
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "window, norm, sinks", [(None, True, False), (5, False, True), (150, False, False), (None, False, True)]
)
@pytest.mark.parametrize("max_len", [40, 700])
@pytest.mark.parametrize("step", ["decode", "packed"])
def test_paged_attention_equals_the_contiguous_reference(triton_kernels, dtype, window, norm, sinks, max_len, step):
    """Three sequences in shuffled blocks of 16 (random block tables, partial last blocks), their
    earlier keys and values in the cache; the step's tokens — one a sequence (decode), or 1, 5
    and a tile's tokens + 5 consecutive tokens (packed: a chunk of a prompt in two tiles) — normed, rotated and
    written at their slots, then attending over their own sequence up to their own position,
    against each sequence's keys held contiguously and attended explicitly (700 entries: in 8
    splits when decoding, 4 packed, each every 8th or 4th block of keys, some empty, a window
    across blocks; with sinks, GPT-OSS's logit a head in each denominator, large enough to take
    much of the probability). A decode step reads its first block of earlier keys apart from the
    step's own (EARLY_READS): the sequence of one token has only its own."""
    heads, kv_heads, dim, block_size = 8, 2, 32, 16
    ends = [1, 18 if max_len < 200 else 301, max_len]  # each sequence's last position + 1
    per_tile = decode_attention.tile_tokens(heads // kv_heads)
    counts = [1, 1, 1] if step == "decode" else [1, 5, per_tile + 5]
    rows = [1, 2, 0]  # sequence b's block-table row
    per_row = -(-max_len // block_size)
    num_blocks = 1 + 3 * per_row + 5
    order = torch.randperm(num_blocks - 1) + 1
    tables = torch.zeros(4, per_row, dtype=torch.int32)  # 3 rows and the scratch row
    tables[:3] = order[: 3 * per_row].view(3, per_row)
    pools = [torch.randn(num_blocks * block_size, kv_heads, dim).to(dtype) for _ in range(2)]
    reference = [[torch.randn(kv_heads, max_len, dim).to(dtype) for _ in range(3)] for _ in range(2)]
    for pool, per_sequence in zip(pools, reference):  # the earlier entries, where the tables say
        for b, row in enumerate(rows):
            slots = (
                tables[row, torch.arange(max_len) // block_size].long() * block_size
                + torch.arange(max_len) % block_size
            )
            pool[slots] = per_sequence[b].transpose(0, 1)
    expected_pools = [pool.clone() for pool in pools]

    positions = torch.cat([torch.arange(end - n, end) for end, n in zip(ends, counts)])
    token_rows = torch.cat([torch.full((n,), row) for row, n in zip(rows, counts)])
    tokens = len(positions)
    slots = tables[token_rows, positions // block_size].long() * block_size + positions % block_size
    q, k, v = (torch.randn(tokens, n * dim).to(dtype) for n in (heads, kv_heads, kv_heads))
    angles = positions[:, None].float() * torch.rand(dim // 2)
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    q_norm, k_norm = (torch.rand(dim).to(dtype) + 0.5 if norm else None for _ in range(2))
    head_sinks = torch.randn(heads).to(dtype) * 2 + 1 if sinks else None
    starts, lengths, first = [], [], 0
    for n in counts:  # runs of at most per_tile tokens of one sequence
        for at in range(first, first + n, per_tile):
            starts.append(at)
            lengths.append(min(per_tile, first + n - at))
        first += n
    assert len(starts) == (3 if step == "decode" else 4)
    if step == "packed":  # a packed step's table has an entry per token: empty tiles after its own (not read)
        starts, lengths = starts + [0] * (tokens - 4), lengths + [0] * (tokens - 4)

    got_q = decode_attention.rope_to_cache(q, k, v, cos, sin, q_norm, k_norm, 1e-6, *pools, slots)
    got = decode_attention.paged_attention(
        got_q,
        *pools,
        tables,
        block_size,
        token_rows,
        positions,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(lengths, dtype=torch.int32),
        torch.tensor([3 if step == "decode" else 4], dtype=torch.int32),
        1 if step == "decode" else per_tile,
        max_len,
        dim**-0.5,
        window,
        token_a_sequence=step == "decode",  # its first block of earlier keys read before the wait
        sinks=head_sinks,
    )

    def heads_of(t, n):  # [N, n·D] -> [N, n, 1, D], normed and rotated as the eager path does
        t = t.view(tokens, n, 1, dim)
        return t if not norm else rms_norm(t, q_norm if n == heads else k_norm, 1e-6)

    rope = cos[:, None], sin[:, None]
    want_q = rotary(heads_of(q, heads), *rope)[:, :, 0]
    want_k = rotary(heads_of(k, kv_heads), *rope)[:, :, 0]
    expected_pools[0][slots], expected_pools[1][slots] = want_k, v.view(tokens, kv_heads, dim)
    want, first = [], 0
    for b, n in enumerate(counts):
        keys, values = (per_sequence[b].clone() for per_sequence in reference)
        keys[:, ends[b] - n : ends[b]] = want_k[first : first + n].transpose(0, 1)
        values[:, ends[b] - n : ends[b]] = v[first : first + n].view(n, kv_heads, dim).transpose(0, 1)
        mask = attention_mask(positions[first : first + n], max_len, window)
        out = grouped_attention(
            want_q[first : first + n].transpose(0, 1)[None], keys[None], values[None], mask, dim**-0.5, head_sinks
        )
        want.append(out[0].transpose(0, 1).reshape(n, -1))
        first += n
    assert rel_err(got_q, want_q) <= tol(dtype)
    assert rel_err(pools[0], expected_pools[0]) <= tol(dtype) and torch.equal(pools[1], expected_pools[1])
    # bf16: q and k rounded after the rotary, then the probabilities before P·V: 2e-2
    assert rel_err(got, torch.cat(want)) <= (tol(dtype) if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_models_decode_with_the_kernels_as_without(triton_kernels, monkeypatch, family):
    """Whole models, rows prefilled at different lengths then decoded together: every fused path
    (Qwen3: q/k norms and a sliding window; Mixtral: neither; GPT-OSS: sinks and a sliding window;
    DeepSeek-V3 takes the GEMV and router paths, its latent attention stays eager) against the
    eager path, and both against the full forward. Heads of 16 (the attention kernels take 16 to
    256)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = FAMILIES[family]
    if config.kv_lora_rank is None:
        config = config.replace(head_dim=16)
    model = build(config, seed=1, device=device).eval()
    takes_kernels = family != "deepseek_v3"  # its latent attention: eager
    input_ids = torch.randint(0, model.config.vocab_size, (3, 11), device=device)
    with torch.no_grad():
        full = model(input_ids).logits
        fused = decode_stepwise(model, input_ids, prefill=[4, 1, 7])
        monkeypatch.setenv("MOEMESH_KERNELS", "torch")
        eager = decode_stepwise(model, input_ids, prefill=[4, 1, 7])
    assert rel_err(fused, eager) <= 1e-5 and rel_err(fused, full) <= 1e-5
    assert not torch.equal(fused, eager)  # the kernels did run
    if takes_kernels:  # and the attention kernels among them: without them the logits are others
        monkeypatch.setattr(decode_attention, "fits", lambda *args: False)
        monkeypatch.setenv("MOEMESH_KERNELS", "triton")
        with torch.no_grad():
            assert not torch.equal(decode_stepwise(model, input_ids, prefill=[4, 1, 7]), fused)
