"""Batch-invariant mode (issue 50, `ops/invariant.py`), CPU, fp32 and bf16: a sequence's tokens and
log-probabilities are the same bits whether it is generated alone or among others — with prompts
prefilled in chunks at other split points, prefixes taken from the cache and sequences preempted
and recomputed — and the trainer's forward of the whole sequence gives each sampled token's
log-probability bit-equal to the engine's, with the same experts chosen in every layer. Exact
equality is the claim, so every comparison is `torch.equal`."""

import pytest
import torch
import torch.nn.functional as F

from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import ModelConfig, build
from moemesh.ops import invariant
from moemesh.train.logprobs import completion_logprobs
from tiny_run import TINY_MODEL

CONFIG = ModelConfig(**TINY_MODEL, initializer_range=0.2)  # wide weights: varied tokens, no near-ties
SETTINGS = [(0.0, 0), (1.0, 1), (0.7, 2)]  # greedy, then seeded sampling at two temperatures


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    first = [0, *torch.randint(1, 256, (17,), generator=generator, device="cpu").tolist()]
    others = [[0, *torch.randint(1, 256, (n,), generator=generator, device="cpu").tolist()] for n in (6, 28, 11)]
    return [first, first[:13] + [5, 6, 7], *others]  # the second shares the first's prefix


def sampled_requests(max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    """Each prompt at each setting, with log-probabilities."""
    return [
        (p, SamplingParams(max_tokens=max_tokens, temperature=t, seed=s, logprobs=0))
        for p in prompts()
        for t, s in SETTINGS
    ]


def generated(model, requests, batch_invariant=True, record_routing=False, **engine):
    """Each (prompt, params) through one scheduler -> its sequences, the scheduler."""
    engine = DecodeEngine(model, max_len=64, batch_invariant=batch_invariant, **engine)
    scheduler = Scheduler(engine, ByteTokenizer(), max_waiting=100, record_routing=record_routing)
    sequences = [scheduler.submit(prompt, params) for prompt, params in requests]
    scheduler.run_until_idle()
    return sequences, scheduler


def logprobs(sequence) -> torch.Tensor:
    return torch.tensor([p.logprob for p in sequence.logprobs])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_s_numbers_do_not_depend_on_its_batch(dtype):
    model = build(CONFIG, seed=1).to(dtype).eval()
    requests = sampled_requests(14)
    # Together: 6 rows, steps of 11 tokens (prompts cut at other points), blocks of 4 in a pool too
    # small for all (sequences preempted and recomputed), prefixes reused.
    together, scheduler = generated(
        model, requests, max_batch=6, max_num_batched_tokens=11, block_size=4, num_blocks=20
    )
    assert scheduler.preemptions > 0 and scheduler.cached_tokens > 0
    for request, sequence in zip(requests, together):
        (alone,), _ = generated(model, [request], max_batch=1, max_num_batched_tokens=64, block_size=16)
        assert sequence.token_ids == alone.token_ids
        assert torch.equal(logprobs(sequence), logprobs(alone))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_trainer_s_logprobs_and_routing_equal_the_engine_s_bit_for_bit(dtype):
    model = build(CONFIG, seed=1).to(dtype).eval()
    requests = sampled_requests(14)
    sequences, scheduler = generated(
        model, requests, record_routing=True, max_batch=6, max_num_batched_tokens=11, block_size=4
    )
    scheduler.routing.stop()
    decisions = 0
    for sequence in sequences:
        scored = completion_logprobs(
            model.train(),
            [sequence.prompt_ids],
            [sequence.token_ids],
            sequence.params.temperature,
            routing=True,
            batch_invariant=True,
        )
        assert torch.equal(scored.logprobs[0].detach(), logprobs(sequence))
        for position, chosen in sequence.routing.items():
            assert torch.equal(chosen, scored.routing[0][position])
            decisions += chosen.numel() // chosen.shape[-1]
    assert decisions > 500


def test_without_the_mode_the_numbers_differ_in_the_last_bits():
    """What the mode is for: the default kernels (a GEMM's order depends on its rows, attention
    over a padded window) give the trainer other last bits than the engine on some tokens."""
    model = build(CONFIG, seed=1).eval()
    requests = [(p, SamplingParams(max_tokens=14, logprobs=0)) for p in prompts()]
    sequences, _ = generated(model, requests, batch_invariant=False, max_batch=6, max_num_batched_tokens=11)
    scored = completion_logprobs(model, [s.prompt_ids for s in sequences], [s.token_ids for s in sequences])
    differ = sum(not torch.equal(ours.detach(), logprobs(s)) for ours, s in zip(scored.logprobs, sequences))
    assert differ > 0


def test_every_forward_of_an_engine_in_the_mode_runs_in_the_mode():
    """Warm-up too: on a GPU it captures the CUDA graphs the steps then replay, so a warm-up out of
    the mode would have every later step replay the default kernels (as it once did)."""

    model = build(CONFIG, seed=1).eval()
    seen = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: seen.append(invariant.on()))
    engine = DecodeEngine(model, max_batch=2, max_len=32, batch_invariant=True)
    engine.warm_up()
    sequences, _ = generated(model, sampled_requests(3)[:2], max_batch=2)
    assert len(sequences) == 2 and len(seen) > 4 and all(seen)
    assert not invariant.on()  # and only there


def test_what_the_mode_does_not_cover_is_refused():
    model = build(CONFIG, seed=1).eval()
    with pytest.raises(ValueError, match="CPU reference runs eagerly"):
        DecodeEngine(model, max_len=32, batch_invariant=True, cuda_graphs=True)
    windowed = build(CONFIG.replace(model_type="gpt_oss", sliding_window=4, layer_types=None), seed=1).eval()
    with pytest.raises(ValueError, match="sliding windows"):
        completion_logprobs(windowed, [[0, 1, 2]], [[3]], batch_invariant=True)
    shifted = torch.tensor([1, 2, 3, 4, 5])  # not rows from position 0
    with invariant.batch_invariant(), pytest.raises(ValueError, match="must be packed rows"):
        model(torch.zeros(1, 5, dtype=torch.long), positions=shifted)
    with invariant.batch_invariant():  # two rows packed in one: the CPU reference (tests/test_data_chat.py)
        model(torch.zeros(1, 5, dtype=torch.long), positions=torch.tensor([0, 1, 2, 0, 1]))
    with invariant.batch_invariant():
        model(torch.zeros(2, 5, dtype=torch.long), positions=torch.arange(5).repeat(2, 1))  # whole rows pass


def test_generate_batch_invariant_prints_what_each_prompt_gives_alone(tmp_path, capsys):
    """`moemesh generate --batch-invariant`: the rows of a prompts file, generated together, are
    what each prompt gives alone."""
    import json

    from moemesh.cli import main

    (tmp_path / "prompts.txt").write_text("def main\nhello\n")
    common = ["generate", "--config", "configs/tiny.toml", "--max-new-tokens", "6", "--batch-invariant"]
    assert main([*common, "--prompts-file", str(tmp_path / "prompts.txt")]) == 0
    together = [json.loads(line)["text"] for line in capsys.readouterr().out.splitlines()]
    for prompt, text in zip(("def main", "hello"), together, strict=True):
        assert main([*common, "--prompt", prompt]) == 0
        assert capsys.readouterr().out == prompt + text + "\n"


def test_the_mode_computes_the_model_s_own_numbers():
    """The same model in another order of sums: fp32 logits and loss within 1e-5 of the default
    forward's (attention's grouped heads, the experts' weighted sum, the head all as there)."""

    model = build(CONFIG.replace(num_attention_heads=8, num_key_value_heads=2), seed=1)
    tokens = torch.randint(1, 256, (3, 21), generator=torch.Generator().manual_seed(2))
    expected = model(tokens, labels=tokens, return_logits=True)
    with invariant.batch_invariant():
        ours = model(tokens, labels=tokens, return_logits=True)
    torch.testing.assert_close(ours.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.loss, expected.loss, rtol=1e-5, atol=1e-6)


# ---- under tensor parallelism (2 processes, gloo) -----------------------------------------------
WORLD = 2


def sampled_over(model, group) -> list[tuple]:
    """Every rank: the engine over `group` in the mode samples (the leader schedules, the others
    follow); -> the leader's (prompt, tokens, temperature, log-probabilities, routing) each."""
    from moemesh.parallel import comm

    engine = DecodeEngine(
        model, max_len=64, max_batch=6, max_num_batched_tokens=11, block_size=4, batch_invariant=True, group=group
    )
    shared = None
    if engine.leader:
        scheduler = Scheduler(engine, ByteTokenizer(), max_waiting=100, record_routing=True)
        requests = sampled_requests(10)
        sequences = [scheduler.submit(p, q) for p, q in requests]
        scheduler.run_until_idle()
        scheduler.routing.stop()
        engine.close()
        shared = [(s.prompt_ids, s.token_ids, s.params.temperature, logprobs(s), s.routing) for s in sequences]
    else:
        engine.follow()
    return comm.all_gather_object(shared)[0]


def scored_bit_equal(model, sequences) -> torch.Tensor:
    """The trainer's forward in the mode on every rank: each sampled token's log-probability and
    each routing decision equal to the engine's, bit for bit; -> the sum of the log-probabilities."""
    total = torch.zeros(())
    for prompt, tokens, temperature, engine_logprobs, routing in sequences:
        scored = completion_logprobs(model, [prompt], [tokens], temperature, routing=True, batch_invariant=True)
        assert torch.equal(scored.logprobs[0].detach(), engine_logprobs)
        for position, chosen in routing.items():
            assert torch.equal(chosen, scored.routing[0][position])
        total = total + scored.logprobs[0].sum()
    return total


def check_engine_and_trainer_bit_equal_under_ep(rank):
    """Expert parallelism for decoding (each rank its experts' share of every token): the engine
    samples in the mode and the trainer scores in the same layout, bit-equal too."""
    import torch.distributed as dist

    from moemesh.parallel.expert import apply_ep_for_decoding
    from moemesh.parallel.mesh import ParallelDims, init_mesh

    mesh = init_mesh(ParallelDims(ep=dist.get_world_size()))
    model = apply_ep_for_decoding(build(CONFIG, seed=1), mesh).eval()
    sequences = sampled_over(model, mesh.group("ep"))
    scored_bit_equal(model, sequences)
    return sum(len(tokens) for _, tokens, *_ in sequences)


def test_under_expert_parallelism_for_decoding_the_trainer_s_logprobs_equal_the_engine_s(pool):
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_ep)) > 100


def check_engine_and_trainer_bit_equal_under_tp(rank):
    """The engine over the tensor-parallel ranks samples in the mode; every rank scores the
    leader's sequences with the trainer's forward in the mode, the logits gathered whole as the
    engine's: every log-probability and routing decision bit-equal (the mode adds the ranks'
    partial sums in rank order, whatever their size: `comm._summed_in_rank_order`), and the
    gradients of their sum each rank's share of one process's (the parallel layouts' tolerance:
    within 1.2e-6 of float64 here)."""
    import torch.distributed as dist

    from moemesh.parallel.data import reduce_gradients
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.tensor import apply_tp
    from numerics import rel_err
    from test_parallel_tensor import kv_heads, local_slice

    world = dist.get_world_size()
    mesh = init_mesh(ParallelDims(tp=world))
    model = apply_tp(build(CONFIG, seed=1), mesh).eval()
    sequences = sampled_over(model, mesh.group("tp"))
    scored_bit_equal(model, sequences).backward()
    reduce_gradients(model, mesh)
    reference = build(CONFIG, seed=1).double()  # one process, float64, the default mode
    sum(
        completion_logprobs(reference, [prompt], [tokens], temperature).logprobs[0].sum()
        for prompt, tokens, temperature, _, _ in sequences
    ).backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = expected[name].grad
        assert rel_err(param.grad, local_slice(name, full, rank, world, kv_heads(reference, name))) <= 1e-5, name
    return sum(len(tokens) for _, tokens, *_ in sequences)


def test_under_tensor_parallelism_the_trainer_s_logprobs_equal_the_engine_s_bit_for_bit(pool):
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_tp)) > 100


# ---- the mode's Triton kernels (ops/invariant.py): compiled on a GPU, interpreted on CPU ---------
# Under Triton's CPU interpreter tl.dot is wrong in bf16 (see test_ops_decode_kernels.py): bf16 is
# checked on GPUs only. Tolerances against float64: fp32 inputs with fp32 products ("ieee") 1e-6
# relative; bf16 inputs with fp32 sums 1e-2 (the output's rounding, and in attention the bf16
# probabilities that multiply the values, as flash attention rounds them).
KERNEL_DTYPES = [
    torch.float32,
    pytest.param(
        torch.bfloat16,
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="the CPU interpreter's bf16 tl.dot is wrong"),
    ),
]


def kernel_tol(dtype) -> float:
    return 1e-6 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_matmul_kernel_computes_a_row_alike_wherever_it_sits(triton_kernels, dtype):
    """Each row's bits whether computed alone, among 130 rows or among 70 others at another place
    of another tile; the gradients the ordinary ones."""
    from numerics import rel_err

    w = torch.randn(70, 45).to(dtype)
    x = torch.randn(130, 45).to(dtype)
    full = invariant.matmul(x, w)
    assert rel_err(full, x.double() @ w.double().T) <= kernel_tol(dtype)
    for i in (0, 1, 63, 64, 129):
        assert torch.equal(invariant.matmul(x[i : i + 1], w)[0], full[i])
    shuffled = torch.cat([torch.randn(37, 45).to(dtype), x[60:93], torch.randn(3, 45).to(dtype)])
    assert torch.equal(invariant.matmul(shuffled, w)[37:70], full[60:93])
    assert invariant.matmul(x[:0], w).shape == (0, 70)
    with invariant.batch_invariant():  # `linear` runs it, with a bias, differentiable
        xg, wg, bias = (t.clone().requires_grad_() for t in (x[:9], w, torch.randn(70).to(dtype)))
        out = invariant.linear(xg.view(3, 3, 45), wg, bias)
    grad = torch.randn_like(out)
    expected = [t.detach().double().requires_grad_() for t in (xg, wg, bias)]
    torch.autograd.backward(out, grad)
    torch.autograd.backward(F.linear(*expected).view(3, 3, 70), grad.double())
    for ours, reference in zip((xg, wg, bias), expected):
        assert rel_err(ours.grad, reference.grad) <= kernel_tol(dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_the_grouped_kernel_computes_each_row_as_the_matmul_kernel_alone(triton_kernels, dtype):
    """Rows sorted by expert (an empty expert, one of 70 rows: two tiles, 70 rows past the last
    group: the kernel's own zeros, in two tiles): each row's bits those of `matmul` of that row
    alone with its expert's weight; the rows past the groups zeros; the two projections'
    gradients the ordinary ones."""
    from moemesh.ops.swiglu import swiglu
    from numerics import rel_err

    sizes = torch.tensor([3, 0, 70, 1, 9])
    rows = int(sizes.sum())
    x = torch.randn(rows + 70, 24).to(dtype)
    gate_up, down = torch.randn(5, 40, 24).to(dtype), torch.randn(5, 24, 20).to(dtype)
    h = invariant.grouped_matmul(x, gate_up, sizes)
    experts = torch.repeat_interleave(torch.arange(5), sizes)
    for i in (0, 2, 3, 40, 72, 73, rows - 1):
        assert torch.equal(h[i], invariant.matmul(x[i : i + 1], gate_up[experts[i]])[0])
    assert not h[rows:].any()
    expected = torch.cat([x[:rows].double()[experts == e] @ gate_up[e].double().T for e in range(5)])
    assert rel_err(h[:rows], expected) <= kernel_tol(dtype)

    params = [t.clone().requires_grad_() for t in (x, gate_up, down)]
    biases = [torch.randn(5, 40).to(dtype).requires_grad_(), torch.randn(5, 24).to(dtype).requires_grad_()]
    out = invariant.experts(params[0], sizes, params[1], params[2], swiglu, *biases)
    assert not out[rows:].any()
    grad = torch.randn_like(out)
    torch.autograd.backward(out[:rows], grad[:rows])
    reference = [t.detach().double().requires_grad_() for t in (*params, *biases)]
    xr, gr, dr, gbr, dbr = reference
    pieces = torch.split(xr[:rows], sizes.tolist())
    want = torch.cat(
        [swiglu(p @ gr[e].T + gbr[e]) @ dr[e].T + dbr[e] for e, p in enumerate(pieces)]  # swiglu: elementwise
    )
    torch.autograd.backward(want, grad[:rows].double())
    assert rel_err(out[:rows], want) <= 10 * kernel_tol(dtype)
    for ours, theirs in zip((*params, *biases), reference):
        assert rel_err(
            ours.grad[:rows] if ours is params[0] else ours.grad,
            theirs.grad[:rows] if ours is params[0] else theirs.grad,
        ) <= 10 * kernel_tol(dtype)


def counted_calls(monkeypatch, module, names: list[str]) -> dict[str, int]:
    """Wrap module's functions `names` to count their calls; returns the live counts."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(module, name)

        def counted(*args, name=name, original=original):
            counts[name] += 1
            return original(*args)

        monkeypatch.setattr(module, name, counted)
    return counts


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens", [70, 1])
def test_the_selected_kernel_computes_each_pair_as_the_grouped_path(triton_kernels, monkeypatch, dtype, tokens):
    """A decode step's experts without the dispatch (`selected_experts`), against the grouped
    path (`experts` over `permute`'s dispatch of the same routing): every (token, slot) row the
    same bits, biases and all, for fresh random routing over 6 experts — expert 0 in one slot of
    every token (70 pairs: two blocks of the fp32 BLOCK_M), 1 to 3 in the other, 4 and 5 chosen
    by none — and for one token; within tolerance of float64. The kernels (interpreted on a CPU
    in fp32); the CPU reference refuses it (it dispatches)."""
    from moemesh.ops import permute
    from moemesh.ops.swiglu import swiglu
    from numerics import rel_err

    k, count, hidden, inner = 2, 6, 45, 36  # K past one BLOCK_K of 32 and not a multiple; 2I past one BLOCK_N
    ids = torch.stack([torch.zeros(tokens, dtype=torch.long), torch.randint(1, 4, (tokens,))], dim=1)
    ids = torch.where(torch.rand(tokens, 1) < 0.5, ids, ids.flip(1))  # expert 0 in either slot
    assert tokens == 1 or (ids == 0).sum() > invariant.BLOCK_M
    x = torch.randn(tokens, hidden).to(dtype)
    gate_up, down = torch.randn(count, 2 * inner, hidden).to(dtype), torch.randn(count, hidden, inner).to(dtype)
    biases = torch.randn(count, 2 * inner).to(dtype), torch.randn(count, hidden).to(dtype)
    with torch.no_grad():
        selected = invariant.selected_experts(x, ids, gate_up, down, swiglu, *biases)
        dispatched = permute(x, ids, count)
        grouped = invariant.experts(dispatched.grouped, dispatched.offsets.diff(), gate_up, down, swiglu, *biases)
    assert selected.shape == (tokens * k, hidden)
    assert torch.equal(selected, grouped[dispatched.position.flatten()])
    xs = x.double().repeat_interleave(k, 0)
    want = torch.stack(
        [
            swiglu((gate_up[e].double() @ row + biases[0][e].double())[None])[0] @ down[e].double().T
            + biases[1][e].double()
            for e, row in zip(ids.flatten().tolist(), xs)
        ]
    )
    assert rel_err(selected, want) <= 10 * kernel_tol(dtype)
    with pytest.raises(ValueError, match="no gradients"):  # refused rather than silently no gradient
        invariant.selected_experts(x, ids, gate_up.clone().requires_grad_(), down, swiglu)
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    with pytest.raises(ValueError, match="kernels' device"):
        invariant.selected_experts(x, ids, gate_up, down, swiglu)


def test_the_selected_kernel_s_own_tiles_keep_the_grouped_row_and_k_blocks():
    """`_selected_tiles` changes only what does not order a row's sums: the grouped launch's
    BLOCK_M (which rows share a tile, as the trainer's grouped kernel cuts them) and BLOCK_K (the
    K loop) stay; columns, warps and stages are its own at a decode step's few rows an expert in
    bf16 and fp16 (every such config gave the grouped config's bits on an H200:
    `bench/kernels/ops.py --selected-tiles`). fp32 and more rows an expert keep the grouped config."""

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rows, n, k in [(0, 1536, 2048), (4, 2048, 768), (16, 384, 2048), (40, 1536, 2048), (300, 2048, 768)]:
            grouped = invariant._tiles(rows, n, dtype)
            own = invariant._selected_tiles(grouped, k)
            assert (own[0], own[2]) == (grouped[0], grouped[2])
            if dtype == torch.float32 or rows > 16:
                assert own == grouped
            else:
                assert own == (16, 128 if k >= 2048 else 64, 128, 4, 3)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("tokens", [7, 1])
def test_a_decode_step_s_experts_skip_the_dispatch_with_the_same_bits(triton_kernels, monkeypatch, family, tokens):
    """The MoE block in the mode for a decode step's tokens: through `selected_experts` and the
    combine at identity positions, its output is the dispatched (grouped) path's bit for bit —
    plain SwiGLU experts, GPT-OSS's expert biases, DeepSeek-V3's shared experts and routed
    scaling — and the block's own numbers (the default path's within 1e-5). GPT-OSS here with
    the plain SwiGLU (a Triton kernel): its clamped SwiGLU is torch ops, which on a CPU give an
    element other bits at a tensor's end (the vectorised loop's scalar tail; not so on a GPU),
    and the two paths put a pair's row at other places."""
    from moemesh.models import moe
    from numerics import rel_err
    from test_models_decoding import FAMILIES

    calls = counted_calls(monkeypatch, invariant, ["selected_experts", "grouped_matmul"])
    config = FAMILIES[family].replace(swiglu_limit=None, swiglu_alpha=None) if family == "gpt_oss" else FAMILIES[family]
    model = build(config, seed=2).to(torch.get_default_device()).eval()
    block = model.model.layers[-1].mlp
    assert (block.experts.down_proj_bias is not None) == (family == "gpt_oss")
    x = torch.randn(tokens, model.config.hidden_size)
    with torch.no_grad():
        routing = block.route(x, stats=False)
        with invariant.batch_invariant():
            selected = block.invariant(x, routing)
            assert calls == {"selected_experts": 1, "grouped_matmul": 0}
            monkeypatch.setattr(moe, "SELECTED_EXPERT_ROWS", 0)  # the dispatched path
            grouped = block.invariant(x, routing)
            assert calls == {"selected_experts": 1, "grouped_matmul": 2}
        dispatched = block.dispatch(x, routing)
        default = block.combine(block.compute_experts(dispatched), dispatched, routing, tokens)
    assert torch.equal(selected, grouped)
    assert rel_err(selected, default) <= 1e-5


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("head_dim", [8, 32])
def test_the_attention_kernel_gives_a_query_the_same_bits_in_any_step(triton_kernels, dtype, head_dim):
    """A sequence of 70 tokens (more than one key block of 64) attended whole (the trainer's
    layout: one block of T a row) and through a paged cache of blocks of 4 in shuffled order —
    each token alone (decode steps), in chunks at other split points beside another sequence's
    (packed steps) — every query's output bit-equal; within tolerance of float64; the whole
    sequence's gradients those of torch's attention."""
    from moemesh.models.kv_cache import PagedKVCache
    from numerics import rel_err

    length, heads, kv_heads, scale = 70, 6, 2, head_dim**-0.5
    q, k, v = (torch.randn(2, length, n, head_dim).to(dtype) for n in (heads, kv_heads, kv_heads))
    whole = invariant.causal_attention(q, k, v, scale)
    expected = F.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=scale, enable_gqa=True
    ).transpose(1, 2)
    assert rel_err(whole, expected) <= 10 * kernel_tol(dtype)
    assert torch.equal(invariant.causal_attention(q[1:, :29], k[1:, :29], v[1:, :29], scale)[0], whole[1, :29])

    cache = PagedKVCache(num_blocks=2 * 18 + 1, block_size=4, rows=2, max_len=72, device=q.device)
    cache.block_tables[:2] = (torch.randperm(2 * 18) + 1).view(2, 18).int()  # block 0 is the null block
    every = torch.arange(length)
    cache.set_step(torch.tensor([0, 1]).repeat_interleave(length), every.repeat(2), length, packed=True)
    cache.write(0, k.flatten(0, 1), v.flatten(0, 1))

    def step(rows, positions, packed):
        cache.set_step(torch.tensor(rows), torch.tensor(positions), length, packed=packed)
        tokens = torch.stack([q[r, p] for r, p in zip(rows, positions)])
        starts, lengths, count, _ = cache.tiles(invariant.tile_tokens(heads // kv_heads))
        return invariant.paged_attention(
            tokens, cache.keys[0], cache.values[0], cache.block_tables, 4, cache.token_rows, cache.positions,
            starts, lengths, count, scale,
        )  # fmt: skip

    decode = step([0, 1, 1], [69, 0, 44], packed=False)
    assert torch.equal(decode, torch.stack([whole[0, 69], whole[1, 0], whole[1, 44]]))
    chunks = step([1] * 13 + [0] * 40 + [1], [*range(7, 20), *range(21, 61), 64], packed=True)
    assert torch.equal(chunks, torch.cat([whole[1, 7:20], whole[0, 21:61], whole[1, 64:65]]))

    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    grads = torch.autograd.grad(invariant.causal_attention(q, k, v, scale), (q, k, v), whole)
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in reference), is_causal=True, scale=scale, enable_gqa=True
    )
    for ours, theirs in zip(grads, torch.autograd.grad(out.transpose(1, 2), reference, whole.double())):
        assert rel_err(ours, theirs) <= 10 * kernel_tol(dtype)


def test_with_the_kernels_the_engine_and_the_trainer_agree_bit_for_bit(triton_kernels, monkeypatch):
    """The tiny model through the kernels (interpreted on CPU, fp32; bf16 on a GPU: bench/serve/decode.py
    --batch-invariant): generated together (prompts in chunks at other split points, a prefix
    reused) each sequence's tokens and log-probabilities are those it gets alone, and equal the
    trainer's, with its routing — the engine's experts by `selected_experts` (no gradients, few
    pairs), the trainer's through the dispatch. (Preemption only prefills again: the CPU
    reference's tests above cover it; the interpreter is slow.)"""

    launches = counted_calls(
        monkeypatch, invariant, ["matmul", "paged_attention", "grouped_matmul", "selected_experts"]
    )
    model = build(CONFIG, seed=1).to(torch.get_default_device()).eval()  # the fixture's device
    with torch.device("cpu"):  # the engine's host-side tensors on the host (the fixture makes the GPU the default)
        first, shares_its_prefix, _, longest, _ = prompts()
        requests = [
            (p, SamplingParams(max_tokens=6, temperature=t, seed=s, logprobs=0))
            for p, (t, s) in zip((first, shares_its_prefix, longest), SETTINGS)
        ]
        together, scheduler = generated(  # eager: the routing is recorded (on a GPU alone's steps are CUDA graphs)
            model,
            requests,
            record_routing=True,
            cuda_graphs=False,
            max_batch=3,
            max_num_batched_tokens=11,
            block_size=4,
            num_blocks=17,
        )
        scheduler.routing.stop()
        assert scheduler.cached_tokens > 0
        # The engine's steps (no gradients, few pairs) skip the dispatch; the trainer's forward
        # below dispatches (grouped_matmul): their bits must still agree.
        assert launches["grouped_matmul"] == 0 and all(launches[n] for n in launches if n != "grouped_matmul"), launches
        for request, sequence in zip(requests, together):
            (alone,), _ = generated(model, [request], max_batch=1, max_num_batched_tokens=64, block_size=16)
            assert sequence.token_ids == alone.token_ids
            assert torch.equal(logprobs(sequence), logprobs(alone))
            scored = completion_logprobs(
                model,
                [sequence.prompt_ids],
                [sequence.token_ids],
                request[1].temperature,
                routing=True,
                batch_invariant=True,
            )
            assert torch.equal(scored.logprobs[0].cpu(), logprobs(sequence))
            for position, chosen in sequence.routing.items():
                assert torch.equal(chosen.cpu(), scored.routing[0][position].cpu())
        assert launches["grouped_matmul"] > 0
