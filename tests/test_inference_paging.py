"""The paged cache under the scheduler (fp32, CPU): chunks of several prompts packed into one
forward beside other sequences' decode tokens under a token budget, prefix sharing, preemption
when blocks run out, and cancellations change no token — each request gets, greedy, exactly the
tokens of its prompt generated alone (and of the no-cache reference), seeded sampling included —
and every block comes back. Blocks of 4 entries, so that sequences span many blocks and end in
partial ones.

Exact token equality is safe here for the reason test_inference_generate gives: random weights
with a wide initialisation keep the top two logits far apart compared with the ~1e-6 by which
differently batched logits differ."""

import pytest
import torch

from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.blocks import BlockPool, block_key
from moemesh.inference.engine import PACKED_BUCKET_STEP, PREVIOUS, DecodeEngine
from moemesh.inference.generate import generate
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import build
from moemesh.ops.backend import HAVE_TRITON
from test_inference_generate import reference
from test_models_decoding import FAMILIES

TOKENIZER = ByteTokenizer()
LENGTHS = [5, 23, 1, 17, 30, 9, 12]


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[0, *torch.randint(1, 256, (n - 1,), generator=generator, device="cpu").tolist()] for n in lengths]


def alone(model, prompt: list[int], params: SamplingParams) -> list[int]:
    return generate(DecodeEngine(model, max_batch=1, max_len=64), TOKENIZER, [prompt], params)[0].token_ids


class Recorder:
    """Wraps engine.launch (what engine.step and the scheduler call): the chunks of every step."""

    def __init__(self, engine: DecodeEngine):
        self.steps, launch = [], engine.launch
        engine.launch = lambda chunks: (self.steps.append(chunks), launch(chunks))[1]


@pytest.fixture(scope="module")
def model():
    return build(FAMILIES["qwen3_moe"].replace(max_position_embeddings=64), seed=5).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4_k_eq_v"])
def test_chunked_prefill_beside_decoding_equals_each_prompt_alone(family):
    model = build(FAMILIES[family].replace(vocab_size=256, max_position_embeddings=64), seed=5).eval()
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=24, block_size=4)
    steps = Recorder(engine).steps
    params = [SamplingParams(max_tokens=n) for n in (9, 4, 12, 7, 3, 10, 6)]
    batch = prompts(LENGTHS)
    results = generate(engine, TOKENIZER, batch, params)
    for prompt, p, result in zip(batch, params, results):
        expected = reference(model, prompt, p.max_tokens)
        assert result.token_ids == alone(model, prompt, p) == expected
    assert all(sum(len(c.tokens) for c in chunks) <= 24 for chunks in steps)  # the budget holds
    # some step packed chunks of two prompts, some step prefilled beside decode tokens, and the
    # prompt of 30 was split
    assert any(sum(len(c.tokens) > 1 for c in chunks) >= 2 for chunks in steps)
    assert any(any(len(c.tokens) > 1 for c in chunks) and any(len(c.tokens) == 1 for c in chunks) for chunks in steps)
    assert any(c.start == 0 and c.tokens == batch[4][: len(c.tokens)] != batch[4] for chunks in steps for c in chunks)
    assert engine.blocks.num_free == engine.cache.num_blocks - 1


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(model):
    """With a budget of 8 tokens a step, a prompt of 40 takes several steps, and the sequence
    already decoding gets its token in every one of them."""
    engine = DecodeEngine(model, max_batch=2, max_len=64, max_num_batched_tokens=8, block_size=4)
    steps = Recorder(engine).steps
    short, long = prompts([3, 40], seed=1)
    scheduler = Scheduler(engine, TOKENIZER)
    first = scheduler.submit(short, SamplingParams(max_tokens=20))
    scheduler.step()  # the short prompt, prefilled, samples its first token
    second = scheduler.submit(long, SamplingParams(max_tokens=5))
    scheduler.run_until_idle()
    assert first.row is None and second.row is None  # rows are given back at the end; the first had row 0
    prefilling = [chunks for chunks in steps[1:] if any(c.row == 1 and len(c.tokens) > 1 for c in chunks)]
    assert len(prefilling) == 6  # 7 + 7 + 7 + 7 + 7 + 5 tokens beside one decode token each
    assert all(any(c.row == 0 and len(c.tokens) == 1 for c in chunks) for chunks in prefilling)
    assert first.token_ids == alone(model, short, SamplingParams(max_tokens=20))
    assert second.token_ids == alone(model, long, SamplingParams(max_tokens=5))


def test_a_prompt_that_fits_a_round_waits_rather_than_split_beside_another(model):
    """At 16 tokens a step, prompts of 10, 8 and 20 come together. The 8 would fit beside the 10
    only split (6 tokens left): it waits and is prefilled whole in the next round. The 20, longer
    than what that round leaves, waits too, then starts in a round of decode tokens alone and
    ends in the one after. The tokens are each prompt's alone."""
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=16, block_size=4)
    steps = Recorder(engine).steps
    batch, params = prompts([10, 8, 20], seed=3), SamplingParams(max_tokens=4)
    scheduler = Scheduler(engine, TOKENIZER)
    sequences = [scheduler.submit(p, params) for p in batch]
    scheduler.run_until_idle()
    prompt_chunks = [[len(c.tokens) for c in chunks if len(c.tokens) > 1] for chunks in steps]
    assert prompt_chunks[:4] == [[10], [8], [14], [6]] and not any(prompt_chunks[4:])
    for prompt, sequence in zip(batch, sequences):
        assert sequence.token_ids == alone(model, prompt, params)


def test_prefill_first_alternates_prompts_rounds_with_decode_rounds(model):
    """With prefill_first, a round that decoded while prompts wait is followed by a round of the
    prompts alone and that by one of the decode tokens alone: no round mixes the two, and no two
    prompts' rounds follow each other while a sequence decodes. The tokens are each prompt's
    alone."""
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=8, block_size=4)
    steps = Recorder(engine).steps
    batch = prompts([3, 20, 6], seed=6)
    params = [SamplingParams(max_tokens=n) for n in (20, 5, 4)]
    scheduler = Scheduler(engine, TOKENIZER, prefill_first=True)
    sequences = [scheduler.submit(batch[0], params[0])]
    scheduler.step()  # the short prompt alone: row 0 decodes from now on
    sequences += [scheduler.submit(p, q) for p, q in zip(batch[1:], params[1:])]
    scheduler.run_until_idle()
    prompt_lengths = [len(p) for p in batch]  # rows 0, 1, 2 were taken in order
    kinds = []
    for chunks in steps[1:]:
        decodes = {c.start >= prompt_lengths[c.row] for c in chunks}
        assert len(decodes) == 1, "a round mixed prompt chunks with decode tokens"
        kinds.append("decode" if decodes.pop() else "prompts")
    # 20 + 6 prompt tokens at 8 a round: 8 | 8 | 4 | 6 (the 6 wait for a round they fit whole), a
    # decode round between each two
    assert kinds[:8] == ["prompts", "decode"] * 4 and set(kinds[8:]) == {"decode"}
    for prompt, p, sequence in zip(batch, params, sequences):
        assert sequence.token_ids == alone(model, prompt, p)
    assert engine.blocks.num_free == engine.cache.num_blocks - 1


def test_followers_of_a_cached_prefix_prefill_only_the_rest_and_match_no_sharing(model):
    prefix = prompts([24], seed=2)[0]  # 6 full blocks of 4
    suffixes = prompts([5, 9, 1], seed=3)
    # the prefix and 4 or 8 more tokens; the prefix alone (twice); a part of it
    requests = [prefix + s[1:] for s in suffixes] + [prefix, prefix[:10]]
    params = SamplingParams(max_tokens=8)
    expected = [alone(model, r, params) for r in requests]
    for prefix_caching in (True, False):
        engine = DecodeEngine(model, max_batch=4, max_len=64, block_size=4, prefix_caching=prefix_caching)
        steps = Recorder(engine).steps
        scheduler = Scheduler(engine, TOKENIZER)
        scheduler.submit(prefix + [7, 7], params)
        scheduler.run_until_idle()  # the first request: its full blocks are cached
        computed_before = sum(len(c.tokens) for chunks in steps for c in chunks)
        followers = [scheduler.submit(r, params) for r in requests]
        scheduler.run_until_idle()
        assert [f.token_ids for f in followers] == expected
        computed = sum(len(c.tokens) for chunks in steps for c in chunks) - computed_before
        decoded = sum(len(f.token_ids) for f in followers) - len(followers)  # each last token fed back
        prefilled = computed - decoded
        if prefix_caching:
            # 24 cached tokens each, but the prefix alone computes its last block again (its last
            # token's logits are needed), and prefix[:10] finds 2 blocks
            assert scheduler.cached_tokens == 2 * 24 + 2 * 20 + 8
            assert prefilled == sum(len(r) for r in requests) - scheduler.cached_tokens
        else:
            assert scheduler.cached_tokens == 0 and prefilled == sum(len(r) for r in requests)
        assert engine.blocks.num_free == engine.cache.num_blocks - 1


def test_prompt_logprobs_of_a_prompt_prefilled_in_chunks_equal_the_full_forward(model):
    """A prompt's own log-probabilities (echo) come from the logits of every chunk of it, here 5
    steps of at most 6 tokens beside another request's decoding; the prefix cache, which would
    skip computing the cached tokens, is not used for such a request (its twin, asked after the
    first filled the cache, gets all of them too). fp32: 1e-5."""
    prompt = prompts([27], seed=4)[0]
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=6, block_size=4)
    scheduler = Scheduler(engine, TOKENIZER)
    other = scheduler.submit(prompts([3], seed=5)[0], SamplingParams(max_tokens=20))
    asked = [scheduler.submit(prompt, SamplingParams(max_tokens=0, prompt_logprobs=2))]
    scheduler.run_until_idle()
    asked.append(scheduler.submit(prompt, SamplingParams(max_tokens=3, prompt_logprobs=2)))
    scheduler.run_until_idle()  # the prompt's 6 full blocks are cached now, and not used
    assert other.finish_reason == "length" and len(other.token_ids) == 20
    assert scheduler.cached_tokens == 0 and engine.blocks.hits == 0
    assert [len(s.token_ids) for s in asked] == [0, 3]
    assert asked[1].token_ids == alone(model, prompt, SamplingParams(max_tokens=3))
    for sequence in asked:
        assert sequence.prompt_logprobs[0] is None and len(sequence.prompt_logprobs) == len(prompt)
        for t, entry in enumerate(sequence.prompt_logprobs[1:], start=1):
            assert entry.logprob == pytest.approx(float(full[t - 1, prompt[t]]), rel=1e-5, abs=1e-5)
            top = full[t - 1].topk(2)
            assert [i for i, _ in entry.top] == top.indices.tolist()
            assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), rel=1e-5, abs=1e-5)
    assert engine.blocks.num_free == engine.cache.num_blocks - 1


@pytest.mark.parametrize("prefill_first", [False, True])
def test_preempted_requests_finish_with_their_own_tokens(model, prefill_first):
    """12 blocks of 4 for 4 requests that grow to 24 tokens each: the youngest are preempted
    (their blocks taken back, recomputed later), a request that does not fit waits; every request
    still gets the tokens it gets alone, seeded sampling included (the noise counts its own
    tokens), and the blocks all come back. With prefill_first too: a preempted sequence's
    recomputation is a prompts' round's work."""
    engine = DecodeEngine(model, max_batch=4, max_len=32, block_size=4, num_blocks=13)
    batch = prompts([9, 8, 10, 7], seed=4)
    params = [
        SamplingParams(max_tokens=14),
        SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(max_tokens=13),
        SamplingParams(max_tokens=16, temperature=0.7, seed=4),
    ]
    scheduler = Scheduler(engine, TOKENIZER, prefill_first=prefill_first)
    sequences = [scheduler.submit(p, q) for p, q in zip(batch, params)]
    scheduler.run_until_idle()
    assert scheduler.preemptions > 0
    for prompt, p, sequence in zip(batch, params, sequences):
        assert sequence.token_ids == alone(model, prompt, p)
        assert sequence.finish_reason in ("length", "stop")
    assert engine.blocks.num_free == 12 and not any(engine.blocks.refs)


def overlap_run(model, batch, params, overlap: bool):
    """The requests through one scheduler, with `overlap` or not, on a pool of 12 blocks of 4 (it
    preempts); -> the sequences, the scheduler, the engine, and the order of its steps' launches
    and reads: ("launch", n, whether a chunk's token was PREVIOUS) and ("read", n)."""
    engine = DecodeEngine(model, max_batch=4, max_len=32, block_size=4, num_blocks=13, max_num_batched_tokens=16)
    order, launch = [], engine.launch

    def recorded(chunks):
        n = sum(event[0] == "launch" for event in order)
        order.append(("launch", n, any(PREVIOUS in c.tokens for c in chunks)))
        launched = launch(chunks)
        tokens = launched.tokens
        launched.tokens = lambda: (order.append(("read", n)), tokens())[1]
        return launched

    engine.launch = recorded
    scheduler = Scheduler(engine, TOKENIZER, overlap=overlap)
    sequences = [scheduler.submit(p, q) for p, q in zip(batch, params)]
    scheduler.run_until_idle()
    return sequences, scheduler, engine, order


def test_overlapped_rounds_read_a_step_s_tokens_after_launching_the_next_and_change_no_token(model):
    """With overlap (the default) a round's step is launched before the last round's tokens are
    read, its decode tokens PREVIOUS (the engine takes them from its own last sample), and a
    sequence that ended meanwhile drops the extra token. Against the same requests without
    overlap: the same tokens, finish reasons and log-probabilities, for greedy and seeded
    sampling, a stop token (found by a first run), max_tokens of 1, the end of the context, a request with
    log-probabilities (processed on the host: its rounds are not overlapped) and preemption
    (blocks run out while a round is in flight); every block comes back."""
    batch = prompts([9, 8, 10, 7, 5, 12, 26], seed=4)
    params = [
        SamplingParams(max_tokens=14),
        SamplingParams(max_tokens=15, temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(max_tokens=13),
        SamplingParams(max_tokens=16, temperature=0.7, seed=4),
        SamplingParams(max_tokens=6, logprobs=2),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=20),  # ends at the context (32) first
    ]
    first, *_ = overlap_run(model, batch, params, overlap=False)
    params[2] = SamplingParams(max_tokens=13, stop_token_ids=(first[2].token_ids[5],))
    runs = {overlap: overlap_run(model, batch, params, overlap) for overlap in (False, True)}
    for i, (plain, overlapped) in enumerate(zip(runs[False][0], runs[True][0])):
        assert overlapped.token_ids == plain.token_ids, i
        assert overlapped.finish_reason == plain.finish_reason, i
        # differently batched rounds: fp32 logits ~1e-6 apart (the module's docstring)
        assert len(overlapped.logprobs) == len(plain.logprobs), i
        for a, b in zip(overlapped.logprobs, plain.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top], i
            values = zip([a.logprob, *dict(a.top).values()], [b.logprob, *dict(b.top).values()])
            assert max(abs(x - y) for x, y in values) < 1e-5, i
    assert runs[True][0][2].finish_reason == "stop" and len(runs[True][0][2].token_ids) <= 5
    assert runs[True][0][6].finish_reason == "length" and len(runs[True][0][6].token_ids) == 32 - 26
    assert runs[True][0][4].logprobs and len(runs[True][0][4].logprobs) == len(runs[True][0][4].token_ids)
    for overlap, (_, scheduler, engine, order) in runs.items():
        assert scheduler.preemptions > 0
        assert engine.blocks.num_free == 12 and not any(engine.blocks.refs)
        assert scheduler._launched is None and not scheduler.running
        # a step launched before the one before it was read (PREVIOUS tokens): only with overlap
        ahead = [e for i, e in enumerate(order) if e[0] == "launch" and ("read", e[1] - 1) in order[i:]]
        assert bool(ahead) == overlap and all(e[2] for e in ahead)
        assert any(e[0] == "launch" and e[2] for e in order) == overlap


def test_blocks_are_all_free_after_a_run_with_cancellations(model):
    engine = DecodeEngine(model, max_batch=3, max_len=64, max_num_batched_tokens=12, block_size=4)
    batch = prompts(LENGTHS, seed=5)
    scheduler = Scheduler(engine, TOKENIZER)

    def cancel_after(count):
        def on_update(sequence, text):
            if len(sequence.token_ids) >= count:
                sequence.cancelled = True

        return on_update

    sequences = [
        scheduler.submit(p, SamplingParams(max_tokens=12), cancel_after(3) if i in (0, 3) else None)
        for i, p in enumerate(batch)
    ]
    sequences[-1].cancelled = True  # still waiting
    scheduler.step()
    scheduler.step()
    prefilling = [s for s in scheduler.running if scheduler.held[s].computed < len(s.prompt_ids)]
    assert len(prefilling) == 1  # part-way through its prompt
    prefilling[0].cancelled = True
    scheduler.run_until_idle()
    assert [s.finish_reason for s in sequences].count("cancelled") == 4
    for i, (prompt, sequence) in enumerate(zip(batch, sequences)):
        if sequence.finish_reason != "cancelled":
            assert sequence.token_ids == alone(model, prompt, SamplingParams(max_tokens=12)), i
    assert engine.blocks.num_free == engine.cache.num_blocks - 1 and not any(engine.blocks.refs)
    assert sorted(scheduler.free_rows) == [0, 1, 2] and not scheduler.held and not scheduler.running


def test_the_block_pool_counts_references_and_evicts_the_least_recently_freed():
    pool = BlockPool(num_blocks=6, block_size=2)
    a = pool.allocate(3)
    assert a == [1, 2, 3] and pool.num_free == 2
    tokens = [5, 6, 7, 8, 9]
    keys = [block_key(None, tokens[:2])]
    keys.append(block_key(keys[0], tokens[2:4]))
    for block, key, start in zip(a, keys, (0, 2)):
        pool.register(block, key, tokens[start : start + 2])
    assert pool.match([5, 6, 7, 8, 1]) == ([1, 2], keys)  # held twice now
    assert pool.match([5, 6, 0, 0]) == ([1], keys[:1])
    assert pool.match([6, 5, 7, 8]) == ([], [])  # the same second block after another first: no match
    pool.release(a)
    assert pool.refs[1:4] == [2, 1, 0] and pool.num_free == 3
    pool.release([1, 2])
    pool.release([1])
    assert list(pool.free) == [4, 5, 3, 2, 1]  # freed order: the tail before the prefix
    assert pool.allocate(3) == [4, 5, 3] and pool.match(tokens) == ([1, 2], keys)
    pool.release([1, 2])
    assert pool.allocate(2) == [2, 1]  # evicted: their keys are gone
    assert pool.match(tokens) == ([], []) and not pool.cached
    with pytest.raises(ValueError, match="1 blocks asked for, 0 free"):
        pool.allocate(1)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_packed_steps_padded_to_buckets_equal_each_prompt_alone(monkeypatch, family):
    """The body of a captured packed step (run eagerly on a CPU, as a CUDA graph on a GPU): tokens
    and samples padded to a bucket in the fixed buffers, the attention's tiles found on the
    device (no host runs), padding in the scratch row. Qwen3's and GPT-OSS's (sinks) attention
    takes the kernels, so their packed steps go through the bucket; DeepSeek-V3's (latent) reads
    the runs on the host, so the engine notices at its first bucket and runs its packed steps
    eagerly from then on — the tokens are right either way."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("MOEMESH_KERNELS", "triton")  # interpreted on a CPU
    config = FAMILIES[family].replace(vocab_size=256, max_position_embeddings=64)
    if config.kv_lora_rank is None:  # (the attention kernels take heads of 16 to 256)
        config = config.replace(head_dim=16)
    model = build(config, seed=5, device="cuda" if torch.cuda.is_available() else "cpu").eval()
    engine = DecodeEngine(
        model, max_batch=4, max_len=64, max_num_batched_tokens=16, block_size=4, packed_graph_tokens=16
    )
    buckets, replay = [], engine._replay
    engine._replay = lambda key, step: (buckets.append(key[0] == "packed"), replay(key, step))[1]
    batch = prompts(LENGTHS[: {"qwen3_moe": None, "gpt_oss": 4, "deepseek_v3": 2}[family]])  # (the interpreter is slow)
    params = [SamplingParams(max_tokens=n) for n in (3, 1, 2, 1, 2, 1, 2)][: len(batch)]
    results = generate(engine, TOKENIZER, batch, params)
    # The no-cache reference by the PyTorch ops, as test_inference_generate computes it: its tokens
    # do not depend on the kernels (the module's docstring), and interpreted it took half of the
    # test's time. The engine's steps above took the kernels.
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    for prompt, p, result in zip(batch, params, results):
        assert result.token_ids == reference(model, prompt, p.max_tokens)
    assert engine.blocks.num_free == engine.cache.num_blocks - 1
    if family != "deepseek_v3":
        assert sum(buckets) > 3 and engine.packed_buckets == [16]  # every packed step went through the bucket
    else:
        # tried once (on a GPU already when the pool was sized from memory), then eager
        assert sum(buckets) <= 1 and engine.packed_buckets == []


def test_packed_step_buckets_pad_less_than_a_third_and_above_256_less_than_a_bucket_step():
    """Padding tokens cost the MoE as much as a prompt's (engine.py): a step of up to 256 tokens
    pads to the next of 16, 24, 32, 48, ... (less than a third of the bucket is padding), a larger
    one to the next multiple of PACKED_BUCKET_STEP (128), up to the graphs' largest step."""
    config = FAMILIES["qwen3_moe"].replace(head_dim=16, vocab_size=256, max_position_embeddings=64)
    model = build(config, seed=5).eval()
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=2048, packed_graph_tokens=2000)
    assert engine.packed_buckets[:9] == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert engine.packed_buckets[9:] == list(range(384, 2000, 128)) + [2000]
    for tokens in range(1, 2001):
        bucket = engine.packed_bucket(tokens)
        assert bucket == 16 if tokens <= 16 else bucket - tokens < (tokens / 2 if tokens <= 256 else PACKED_BUCKET_STEP)
    assert engine.packed_bucket(2001) is None  # larger than the graphs' largest step: eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the compiled kernels and CUDA graphs")
def test_on_a_gpu_chunked_prefill_and_graphed_decoding_equal_the_reference():
    """fp32 on the GPU: packed steps and decode steps replayed from CUDA graphs (the packed ones
    padded to their bucket), through the compiled paged-attention kernels, a pool sized from free
    memory."""
    config = FAMILIES["qwen3_moe"].replace(head_dim=16, max_position_embeddings=64)  # heads the kernels take
    model = build(config, seed=5, device="cuda").eval()
    engine = DecodeEngine(model, max_batch=4, max_len=64, max_num_batched_tokens=16, block_size=4)
    assert engine.cuda_graphs and engine.cache.num_blocks > 4 * 16
    engine.warm_up()
    batch = prompts(LENGTHS)
    params = [SamplingParams(max_tokens=n) for n in (9, 4, 12, 7, 3, 10, 6)]
    results = generate(engine, TOKENIZER, batch, params)
    assert {key[0] for key in engine.graphs} >= {"packed", 1}  # packed and decode steps ran as graphs
    for prompt, p, result in zip(batch, params, results):
        assert result.token_ids == reference(model, prompt, p.max_tokens)
