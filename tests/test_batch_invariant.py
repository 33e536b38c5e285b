"""Batch-invariant mode (issue 50, `ops/invariant.py`), CPU, fp32 and bf16: a sequence's tokens and
log-probabilities are the same bits whether it is generated alone or among others — with prompts
prefilled in chunks at other split points, prefixes taken from the cache and sequences preempted
and recomputed — and the trainer's forward of the whole sequence gives each sampled token's
log-probability bit-equal to the engine's, with the same experts chosen in every layer. Exact
equality is the claim, so every comparison is `torch.equal`."""

import pytest
import torch

from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import ModelConfig, build
from moemesh.train.logprobs import completion_logprobs
from tiny_run import TINY_MODEL

CONFIG = ModelConfig(**TINY_MODEL, initializer_range=0.2)  # wide weights: varied tokens, no near-ties
SETTINGS = [(0.0, 0), (1.0, 1), (0.7, 2)]  # greedy, then seeded sampling at two temperatures


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    first = [0, *torch.randint(1, 256, (17,), generator=generator).tolist()]
    others = [[0, *torch.randint(1, 256, (n,), generator=generator).tolist()] for n in (6, 28, 11)]
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


def test_what_the_mode_does_not_cover_is_refused():
    model = build(CONFIG, seed=1).eval()
    with pytest.raises(ValueError, match="batch-invariant mode runs eagerly"):
        DecodeEngine(model, max_len=32, batch_invariant=True, cuda_graphs=True)
    windowed = build(CONFIG.replace(model_type="gpt_oss", sliding_window=4, layer_types=None), seed=1).eval()
    with pytest.raises(ValueError, match="sliding windows"):
        completion_logprobs(windowed, [[0, 1, 2]], [[3]], batch_invariant=True)


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
    from moemesh.ops import invariant

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
    from moemesh.parallel.expert import apply_ep_for_decoding
    from moemesh.parallel.mesh import ParallelDims, init_mesh

    mesh = init_mesh(ParallelDims(ep=WORLD))
    model = apply_ep_for_decoding(build(CONFIG, seed=1), mesh).eval()
    sequences = sampled_over(model, mesh.group("ep"))
    scored_bit_equal(model, sequences)
    return sum(len(tokens) for _, tokens, *_ in sequences)


def test_under_expert_parallelism_for_decoding_the_trainer_s_logprobs_equal_the_engine_s(pool):
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_ep)) > 100


def check_engine_and_trainer_bit_equal_under_tp(rank):
    """The engine over 2 tensor-parallel ranks samples in the mode; both ranks score the leader's
    sequences with the trainer's forward in the mode, the logits gathered whole as the engine's:
    every log-probability and routing decision bit-equal (a sum of two partial sums has one
    order), and the gradients of their sum each rank's share of one process's (the parallel
    layouts' tolerance: within 1.2e-6 of float64 here)."""
    from moemesh.parallel.data import reduce_gradients
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.tensor import apply_tp
    from numerics import rel_err
    from test_parallel_tensor import local_slice

    mesh = init_mesh(ParallelDims(tp=WORLD))
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
        assert rel_err(param.grad, local_slice(name, expected[name].grad, rank, WORLD)) <= 1e-5, name
    return sum(len(tokens) for _, tokens, *_ in sequences)


def test_under_tensor_parallelism_the_trainer_s_logprobs_equal_the_engine_s_bit_for_bit(pool):
    assert min(pool.run(check_engine_and_trainer_bit_equal_under_tp)) > 100
