"""Weights handed to a running engine in place (`DecodeEngine.load_weights`, issue 50): after the
hand-off the engine generates, greedy, exactly the tokens of an engine built fresh on the new
weights — its prefix cache, filled under the old weights, serves none of its blocks (without the
reset it would, and the tokens would change: checked) — from a model, a state dict, or a LoRA
model whose adapters are merged on the way (the source keeps them). Names or shapes that do not
fit, and sequences still holding blocks, are refused before anything changes. The same from
another process (`send_weights` / `receive_weights`): a spawned child sends its model over a pipe,
through shared memory on CPU (CUDA IPC on a GPU: bench/serve/model_load.py --hand-over N --ipc).

Exact token equality is safe for the reason test_inference_generate gives: random weights at
std 0.2 keep the top two logits far apart compared with the ~1e-6 by which differently batched
logits differ. fp32, CPU."""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.generate import generate
from moemesh.inference.request import SamplingParams
from moemesh.inference.scheduler import Scheduler
from moemesh.models import ModelConfig, build
from moemesh.models.lora import LoraConfig, apply_lora, merge_adapters
from moemesh.models.weights import copy_weights, receive_weights, send_weights
from tiny_run import TINY_MODEL

CONFIG = ModelConfig(**TINY_MODEL, initializer_range=0.2)
TOKENIZER = ByteTokenizer()
# Prompts of 2 to 4 full blocks of 4 that share their first 8 tokens: the prefix cache serves them.
PROMPTS = [[0, 11, 12, 13, 14, 15, 16, 17, *tail] for tail in ([30, 31, 32, 33], [40, 41, 42, 43, 44, 45, 46, 47], [])]
GREEDY = SamplingParams(max_tokens=10)
TIMEOUT = 120  # seconds: no wait on the other process is longer (a spawned child imports torch first)


def engine_of(model) -> DecodeEngine:
    return DecodeEngine(model.eval(), max_batch=2, max_len=64, block_size=4)


def tokens(engine) -> list[list[int]]:
    return [s.token_ids for s in generate(engine, TOKENIZER, PROMPTS, GREEDY)]


def test_an_engine_given_new_weights_generates_what_a_fresh_engine_on_them_does():
    old, new = build(CONFIG, seed=1), build(CONFIG, seed=2)
    engine = engine_of(copy.deepcopy(old))
    before = tokens(engine)
    assert engine.blocks.cached  # the prompts' full blocks are keyed
    expected = tokens(engine_of(new))
    assert expected != before

    engine.load_weights(new)
    assert not engine.blocks.cached
    hits = engine.blocks.hits
    assert tokens(engine) == expected
    assert engine.blocks.hits > hits  # the prompts' shared prefix is cached again, under the new weights
    for name, tensor in engine.model.state_dict().items():
        torch.testing.assert_close(tensor, new.state_dict()[name], rtol=0, atol=0)

    # From a state dict, back to the old weights: the old tokens again.
    engine.load_weights(old.state_dict())
    assert tokens(engine) == before


def test_without_the_prefix_cache_reset_stale_blocks_would_change_the_tokens():
    """What `load_weights` guards against: the weights copied alone, the prompts' cached blocks
    (keys and values of the old weights) are reused and the tokens are not the new model's."""
    old, new = build(CONFIG, seed=1), build(CONFIG, seed=2)
    engine = engine_of(copy.deepcopy(old))
    tokens(engine)
    copy_weights(engine.model, new)
    hits = engine.blocks.hits
    stale = tokens(engine)
    assert engine.blocks.hits > hits
    assert stale != tokens(engine_of(new))


def test_a_lora_model_is_handed_over_merged_and_keeps_its_adapters():
    base = build(CONFIG, seed=1)
    adapted = copy.deepcopy(base)
    apply_lora(adapted, LoraConfig(rank=4, alpha=8.0, targets=["q_proj", "o_proj"], experts=True))
    generator = torch.Generator().manual_seed(0)
    for name, param in adapted.named_parameters():
        if "lora_" in name:  # B starts at zero: give the adapters something to say
            param.data = torch.randn(param.shape, generator=generator) * 0.3
    merged = copy.deepcopy(adapted)
    merge_adapters(merged)
    expected = tokens(engine_of(merged))
    engine = engine_of(copy.deepcopy(base))
    assert tokens(engine) != expected
    engine.load_weights(adapted)
    assert tokens(engine) == expected
    assert sum("lora_" in name for name, _ in adapted.named_parameters()) == 4 * 2 + 2 * 2 * 2


def test_weights_that_do_not_fit_are_refused_before_anything_changes():
    engine = engine_of(build(CONFIG, seed=1))
    kept = {name: t.clone() for name, t in engine.model.state_dict().items()}
    state = build(CONFIG, seed=2).state_dict()
    wider = build(CONFIG.replace(moe_intermediate_size=48), seed=2)
    with pytest.raises(
        ValueError,
        match=r"4 of another shape \(model.layers.0.mlp.experts.gate_up_proj \(4, 96, 32\) into \(4, 64, 32\)",
    ):
        engine.load_weights(wider)
    with pytest.raises(ValueError, match=r"1 missing \(lm_head.weight\).*1 unexpected \(lm_head.bias\)"):
        engine.load_weights(
            {**{n: t for n, t in state.items() if n != "lm_head.weight"}, "lm_head.bias": torch.zeros(256)}
        )
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, kept[name]), name


def test_new_weights_are_refused_while_a_sequence_holds_blocks():
    engine = engine_of(build(CONFIG, seed=1))
    scheduler = Scheduler(engine, TOKENIZER)
    scheduler.submit(PROMPTS[1], GREEDY)
    scheduler.step()  # running: it holds its blocks
    kept = engine.model.lm_head.weight.clone()
    with pytest.raises(RuntimeError, match="held by running sequences"):
        engine.load_weights(build(CONFIG, seed=2))
    assert torch.equal(engine.model.lm_head.weight, kept) and engine.blocks.cached
    scheduler.run_until_idle()
    engine.load_weights(build(CONFIG, seed=2))  # finished: now it may


SOURCES = {  # what a spawned child sends, by name: made there
    "seed 2": lambda: build(CONFIG, seed=2),
    "wider": lambda: build(CONFIG.replace(moe_intermediate_size=48), seed=2),
    "no LM head": lambda: {n: t for n, t in build(CONFIG, seed=2).state_dict().items() if n != "lm_head.weight"},
}


def _send(connection, names: list[str]) -> None:
    """In a spawned child: each named source to the parent, then what came back."""
    torch.set_num_threads(1)
    for name in names:
        try:
            connection.send(("copied", send_weights(connection, SOURCES[name](), timeout=TIMEOUT)))
        except ValueError as error:
            connection.send(("refused", str(error)))


def _from_a_child(names: list[str], receive) -> list:
    """`receive(connection)` for each source that a spawned child sends (`_send`); what the child
    reports, in order. Every wait has a timeout; the child is killed if it outlives the test."""
    context = mp.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=_send, args=(theirs, names), daemon=True)
    child.start()
    theirs.close()  # so that a dead child is seen (EOF), not waited for
    try:
        reports = []
        for _ in names:
            receive(mine)
            assert mine.poll(TIMEOUT), "the child did not report"
            reports.append(mine.recv())
        child.join(TIMEOUT)
        assert child.exitcode == 0, f"the child exited with {child.exitcode}"
        return reports
    finally:
        if child.is_alive():
            child.kill()
        mine.close()


def test_an_engine_in_another_process_is_given_new_weights():
    engine = engine_of(build(CONFIG, seed=1))
    tokens(engine)  # fills the prefix cache under the old weights
    expected = tokens(engine_of(build(CONFIG, seed=2)))
    counts = []
    reports = _from_a_child(["seed 2"], lambda c: counts.append(receive_weights(c, engine.load_weights, TIMEOUT)))
    n = len(engine.model.state_dict())
    assert counts == [n] and reports == [("copied", n)]
    assert tokens(engine) == expected


def test_weights_from_another_process_that_do_not_fit_are_refused_on_both_sides():
    engine = engine_of(build(CONFIG, seed=1))
    kept = {name: t.clone() for name, t in engine.model.state_dict().items()}
    errors = []

    def receive(connection):
        with pytest.raises(ValueError, match="weights do not fit the model") as error:
            receive_weights(connection, engine.load_weights, TIMEOUT)
        errors.append(str(error.value))

    reports = _from_a_child(["wider", "no LM head"], receive)
    assert "4 of another shape (model.layers.0.mlp.experts.gate_up_proj (4, 96, 32) into (4, 64, 32)" in errors[0]
    assert "1 missing (lm_head.weight)" in errors[1]
    assert reports == [("refused", f"the receiving process took no weights: ValueError: {e}") for e in errors]
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, kept[name]), name


def test_an_fsdp_sharded_source_is_refused_before_anything_is_sent():
    """A DTensor shard (one rank's part of an FSDP-sharded weight) would be sent as the whole
    weight: refused, on either path, nothing sent. A process group of one rank, in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = build(CONFIG, seed=2).state_dict()
        mesh = DeviceMesh("cpu", [0])
        state["lm_head.weight"] = distribute_tensor(state["lm_head.weight"], mesh, [Shard(0)])
        mine, theirs = mp.get_context("spawn").Pipe()
        with pytest.raises(ValueError, match=r"1 FSDP-sharded tensors \(lm_head.weight\): gather them first"):
            send_weights(mine, state)
        assert not theirs.poll(0)
        with pytest.raises(ValueError, match=r"1 FSDP-sharded \(gather them first\) \(lm_head.weight\)"):
            copy_weights(build(CONFIG, seed=1), state)
    finally:
        dist.destroy_process_group()
