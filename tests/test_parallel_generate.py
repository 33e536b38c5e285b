"""Generation under tensor parallelism (CPU, gloo, fp32) against one process: the decode engine
over 2 ranks, the leader scheduling and broadcasting each step's inputs, gives one process's
greedy and seeded-sampled tokens for a batch of prompts, with a KV cache of this rank's heads and
one logits all-gather per prefill and per decode step; `torchrun ... moemesh generate --tp 2`
prints what one process prints."""

import json
import os
import subprocess
import sys
from multiprocessing import shared_memory

import numpy as np
import pytest
import torch

from moemesh.checkpoint.hf import save_pretrained
from moemesh.cli import main
from moemesh.data.tokenizer import ByteTokenizer
from moemesh.inference.engine import Chunk, DecodeEngine
from moemesh.inference.generate import generate
from moemesh.inference.request import SamplingParams
from moemesh.models import ModelConfig, build
from moemesh.parallel import channel, comm
from moemesh.parallel.expert import apply_ep_for_decoding
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp, apply_tp_whole_experts
from multiprocess import WorkerPool
from tiny_run import TINY_MODEL

TP = 2
# Random weights with a wide initialisation: varied tokens, and no near-ties for the rounding
# differences of the sharded sums to flip.
CONFIG = ModelConfig(**TINY_MODEL, initializer_range=0.2)
PROMPTS = [[0, 100, 101, 102], [0, 7], [0, 50, 51, 52, 53, 54]]
PARAMS = [
    SamplingParams(max_tokens=12),
    SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3),
    SamplingParams(max_tokens=10, temperature=0.7, seed=4),
]


def generate_under_tp(config, prompts, params, max_len, axis="tp", lay_out=None) -> DecodeEngine:
    """Warm up and generate on the TP group (or, with axis "ep", expert-parallel for decoding: the
    experts split, the rest replicated; or as `lay_out` lays the model out over the group's
    ranks) — the leader checks one process's tokens, the others follow — with the collectives
    counted from the engine's start; -> this rank's engine."""
    tokenizer = ByteTokenizer()
    expected = generate(
        DecodeEngine(build(config, seed=5).eval(), max_batch=2, max_len=max_len), tokenizer, prompts, params
    )
    mesh = init_mesh(ParallelDims(**{axis: TP}))
    lay_out = lay_out or (apply_tp if axis == "tp" else apply_ep_for_decoding)
    engine = DecodeEngine(
        lay_out(build(config, seed=5), mesh).eval(), max_batch=2, max_len=max_len, group=mesh.group(axis)
    )
    comm.reset_counts()
    if engine.leader:
        engine.warm_up()  # as `moemesh serve` starts: the followers run its steps too
        results = generate(engine, tokenizer, prompts, params)
        engine.close()
        assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    else:
        engine.follow()
    return engine


def check_generation(rank):
    engine = generate_under_tp(CONFIG, PROMPTS, PARAMS, max_len=32)
    assert engine.cache.keys[0].shape[1] == CONFIG.num_key_value_heads // TP  # [rows, heads, max_len, head_dim]
    return comm.calls[("all_gather", "forward")], comm.sent_bytes[("all_gather", "forward")]


def check_ep_generation(rank):
    """Expert parallelism for decoding: each rank its half of the experts, attention, KV cache and
    vocabulary whole; one all-reduce a MoE layer per forward, no logits gathered."""
    engine = generate_under_tp(CONFIG, PROMPTS, PARAMS, max_len=32, axis="ep")
    assert engine.model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == CONFIG.num_experts // TP
    assert engine.cache.keys[0].shape[1] == CONFIG.num_key_value_heads  # every head here
    forwards = comm.calls[("all_reduce", "forward")] / CONFIG.num_hidden_layers
    assert forwards == int(forwards) > len(PROMPTS) and ("all_gather", "forward") not in comm.calls
    return True


def check_whole_experts_generation(rank):
    """Tensor parallelism with whole experts (`apply_tp_whole_experts`): heads, KV cache and
    vocabulary split as under TP, each rank E/tp experts whole (decode steps through the
    selected experts' path on its own experts); one process's tokens, with TP's two all-reduces a
    layer per forward."""
    engine = generate_under_tp(CONFIG, PROMPTS, PARAMS, max_len=32, lay_out=apply_tp_whole_experts)
    experts = engine.model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (
        CONFIG.num_experts // TP,
        2 * CONFIG.moe_intermediate_size,
        CONFIG.hidden_size,
    )
    assert engine.cache.keys[0].shape[1] == CONFIG.num_key_value_heads // TP
    forwards = comm.calls[("all_gather", "forward")]
    assert forwards > len(PROMPTS) and comm.calls[("all_reduce", "forward")] == forwards * (
        1 + 2 * CONFIG.num_hidden_layers
    )
    return True


def check_a_decode_step_is_one_broadcast(rank):
    """The leader announces a decode step and sends its inputs in one broadcast; the step's
    collectives otherwise: the embedding's all-reduce, two a layer, one logits all-gather."""
    mesh = init_mesh(ParallelDims(tp=TP))
    engine = DecodeEngine(apply_tp(build(CONFIG, seed=5), mesh).eval(), max_batch=2, max_len=16, group=mesh.group("tp"))
    if not engine.leader:
        return engine.follow()
    engine.set_blocks(0, [1])  # max_len 16: one block of 16
    engine.step([Chunk(0, [5, 6, 7], 0)])  # the prompt (a packed step) and the table row's blocks
    comm.reset_counts()
    engine.step([Chunk(0, [8], 3)])
    engine.close()
    issued = {kind: n for (kind, _), n in comm.calls.items()}
    assert issued == {"broadcast": 2, "all_reduce": 1 + 2 * CONFIG.num_hidden_layers, "all_gather": 1}  # with close's


def check_the_leader_s_messages(rank):
    """The channel from the leader (parallel/channel.py): 3 rings' worth of messages of varied
    lengths, each received whole and in order, counted as a broadcast each; with shared memory
    off (ranks on several hosts) the same through a broadcast; a follower that hears nothing
    raises within its timeout rather than waiting forever, its device busy or not; the leader's
    segment is gone once it closes."""
    group = init_mesh(ParallelDims(tp=TP)).group("tp")
    messages = [np.arange(n, dtype=np.int64) * (i + 1) for i, n in enumerate(range(1, 3 * channel.SLOTS + 1))]
    seen = {}
    for shared in (True, False):
        channel.SHARED_MEMORY = shared
        try:
            opened = channel.open_channel(group, 8 * len(messages[-1]), torch.device("cpu"))
        finally:
            channel.SHARED_MEMORY = True
        comm.reset_counts()
        if rank == 0:
            for message in messages:
                opened.send(message)
        else:
            got = [opened.receive() for _ in messages]
            assert all(np.array_equal(a, b) for a, b in zip(got, messages))
        assert comm.calls[("broadcast", "forward")] == len(messages)
        seen[type(opened).__name__] = getattr(getattr(opened, "segment", None), "name", None)
        torch.distributed.barrier(group)
        if rank == 1 and shared:
            opened.timeout_s = 0.05
            with pytest.raises(channel.ChannelTimeout):
                opened.receive()
            asked = []  # a follower whose device stays busy spins, asking, and still times out
            with pytest.raises(channel.ChannelTimeout):
                opened.receive(busy=lambda: asked.append(1) or True)
            assert len(asked) > 10
        torch.distributed.barrier(group)
        opened.close()
    torch.distributed.barrier(group)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=seen["SharedMemoryChannel"])
    return sorted(seen)


class _TooLarge(Exception):
    pass


def check_ranks_agree_on_tiles(rank):
    """The autotuner's benchmark (`backend.agreed_timing`) inside `agreed_tiles(group)`: each config
    timed on every rank and summed, so the ranks pick one config where each alone would pick its
    own; a config that fails on one rank (past its resources) is infinitely slow on the other,
    and the failing rank raises; outside, each rank's own times. (The times here stand in for
    the GPU's: rank 0 finds config a faster, rank 1 config b.)"""
    from moemesh.ops import backend

    group = init_mesh(ParallelDims(tp=TP)).group("tp")
    own = {"a": [1.0 + 2 * rank] * 3, "b": [2.0 - 0.5 * rank] * 3}  # rank 0: a 1, b 2; rank 1: a 3, b 1.5

    def fails():
        if rank == 1:
            raise _TooLarge("past the shared memory")
        return [0.5] * 3

    timed, backend._timed = backend._timed, lambda call, quantiles: call()
    try:
        alone = {name: backend.agreed_timing(lambda t=t: t, (0.5, 0.2, 0.8)) for name, t in own.items()}
        with backend.agreed_tiles(group):
            agreed = {name: backend.agreed_timing(lambda t=t: t, (0.5, 0.2, 0.8)) for name, t in own.items()}
            try:
                failed = backend.agreed_timing(fails, (0.5, 0.2, 0.8))
            except _TooLarge:
                failed = "raised"
    finally:
        backend._timed = timed
    assert agreed == {"a": [4.0] * 3, "b": [3.5] * 3}
    return min(alone, key=alone.get), min(agreed, key=agreed.get), failed


def test_a_graph_s_collectives_are_counted_at_each_replay():
    """What a CUDA graph's capture issues is not counted then (nothing ran), but at each replay."""
    comm.reset_counts()
    _, issued = comm.counted_apart(lambda: comm._count("all_reduce", "forward", 4096))
    assert comm.calls[("all_reduce", "forward")] == 0
    comm.recount(issued)
    comm.recount(issued)
    assert (comm.calls[("all_reduce", "forward")], comm.sent_bytes[("all_reduce", "forward")]) == (2, 8192)


def check_each_rank_reads_only_its_shard(rank, hf_dir):
    """A Hugging Face directory under TP: each rank reads from the safetensors exactly the
    elements it keeps (its heads, expert slices, vocabulary rows; the norms and router whole),
    never a whole sharded tensor — how a model larger than one GPU (470 GB of Qwen3-235B-A22B)
    is read by four."""
    from moemesh.checkpoint import lazy
    from moemesh.inference.generate import load_for_generation

    read = []
    box = lazy.Stored._box
    lazy.Stored._box = lambda self, boxes: read.append(box(self, boxes).numel()) or box(self, boxes)
    try:
        model, _ = load_for_generation(hf_dir, "bytes", mesh=init_mesh(ParallelDims(tp=TP)))
    finally:
        lazy.Stored._box = box
    kept = {t.data_ptr(): t.numel() for t in model.state_dict().values()}  # tied weights once
    whole = sum(t.numel() for t in build(CONFIG).state_dict().values())
    return sum(read), sum(kept.values()), whole


@pytest.fixture(scope="module")
def tp_pool():
    """The TP ranks, started once for the module's checks on them; 600 s a check (the decoding
    kernels run interpreted on CPU)."""
    pool = WorkerPool(TP, timeout_s=600)
    yield pool
    pool.close()


def test_tp_generation_equals_one_process(tp_pool, tmp_path):
    save_pretrained(build(CONFIG, seed=5), tmp_path / "hf")
    pool = tp_pool
    (gathers, gathered), follower = pool.run(check_generation)
    pool.run(check_a_decode_step_is_one_broadcast)
    channels = pool.run(check_the_leader_s_messages)
    reads = pool.run(check_each_rank_reads_only_its_shard, str(tmp_path / "hf"))
    pool.run(check_ep_generation)
    pool.run(check_whole_experts_generation)
    tiles = pool.run(check_ranks_agree_on_tiles)
    assert channels == [["BroadcastChannel", "SharedMemoryChannel"]] * TP
    assert tiles == [("a", "b", [float("inf")] * 3), ("b", "b", "raised")]
    for read, kept, whole in reads:
        assert 0 < read == kept < 0.6 * whole, (read, kept, whole)
    assert follower == (gathers, gathered)  # the follower ran every step the leader ran
    # one all-gather of [rows, V / tp] fp32 logits per prefill and per decode step (1 or 2 rows),
    # the warm-up's two steps (batch 1 and 2) included
    assert len(PROMPTS) + 2 < gathers <= len(PROMPTS) + 2 + sum(p.max_tokens for p in PARAMS)
    assert gathered % (CONFIG.vocab_size // TP * 4) == 0


def check_generation_with_kernels(rank, whole_experts=False):
    """Heads of 16, so that the decoding kernels serve attention too, interpreted on CPU; with
    `whole_experts` the decoding kernels (per token for a decode step, per expert for a prompt)
    skip the pairs of the other rank's experts."""
    config = CONFIG.replace(head_dim=16)
    lay_out = apply_tp_whole_experts if whole_experts else None
    generate_under_tp(config, PROMPTS[:2], [SamplingParams(max_tokens=4)] * 2, max_len=16, lay_out=lay_out)
    # Per forward (a prefill or a decode step: one logits all-gather each): the vocabulary-split
    # embedding's all-reduce, then two a layer (after o_proj, after the MoE block's weighted sum).
    forwards = comm.calls[("all_gather", "forward")]
    assert comm.calls[("all_reduce", "forward")] == forwards * (1 + 2 * config.num_hidden_layers)


def check_packed_steps_in_buckets(rank):
    """Packed steps under TP with a bucket (as captured on a GPU; replayed plainly here): a step of
    prompts goes through the bucket, one with a prompt that wants its every token's logits runs
    eagerly, on every rank alike (the follower reads which from the message: it no longer reads
    the step's inputs back); the sampled tokens and those logits are one process's."""
    config = CONFIG.replace(head_dim=16)
    mesh = init_mesh(ParallelDims(tp=TP))

    def engine_of(model, group=None):
        engine = DecodeEngine(model.eval(), max_batch=2, max_len=16, packed_graph_tokens=16, group=group)
        engine.paths, replay = [], engine._replay
        engine._replay = lambda key, step: (engine.paths.append(key[0]), replay(key, step))[1]
        for row in range(2):
            engine.set_blocks(row, [row + 1])
        return engine

    steps = [
        [Chunk(0, [5, 6, 7], 0), Chunk(1, [9, 10], 0)],  # a bucket of 16
        [Chunk(0, [8, 11], 3, all_logits=True), Chunk(1, [12], 2)],  # eager: every logit of chunk 0
    ]
    engine = engine_of(apply_tp(build(config, seed=5), mesh), mesh.group("tp"))
    if not engine.leader:
        engine.follow()
        return engine.paths
    alone = engine_of(build(config, seed=5))
    for chunks in steps:
        assert engine.step(chunks) == alone.step(chunks)
    # fp32 sums split over the ranks round apart: measured 9.5e-7 on logits up to 3.6
    torch.testing.assert_close(engine.last_all_logits[0], alone.last_all_logits[0], rtol=1e-5, atol=1e-5)
    engine.close()
    assert engine.paths == alone.paths == ["packed"]
    return engine.paths


def with_the_kernels(rank, check, *args):
    """`check` on this rank with MOEMESH_KERNELS=triton (read at every call); the variable put back after."""
    before = os.environ.get("MOEMESH_KERNELS")
    os.environ["MOEMESH_KERNELS"] = "triton"
    try:
        return check(rank, *args)
    finally:
        if before is None:
            os.environ.pop("MOEMESH_KERNELS")
        else:
            os.environ["MOEMESH_KERNELS"] = before


def test_tp_generation_with_the_decoding_kernels(tp_pool):
    """The Triton decoding kernels (ops/gemv.py, decode_attention.py, topk_softmax.py, the fused
    expert GEMVs) on each rank's heads and expert slices, the block's reduce after the fused
    weighted sum: one process's tokens, with two all-reduces a layer per token (counted)."""
    from moemesh.ops.backend import HAVE_TRITON, INTERPRETED

    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    if not INTERPRETED:
        pytest.skip(
            "its ranks are CPU processes (gloo) whose kernels run in Triton's interpreter, which a GPU host "
            "leaves off (tests/conftest.py); across GPUs, bench/serve/decode.py --tensor-parallel checks the tokens"
        )
    tp_pool.run(with_the_kernels, check_generation_with_kernels)
    tp_pool.run(with_the_kernels, check_generation_with_kernels, True)
    assert tp_pool.run(with_the_kernels, check_packed_steps_in_buckets) == [["packed"]] * TP


def check_copied_key_value_heads(rank, hf_dir, config_file):
    """TP 4 over the tiny model's 2 key/value heads: each rank keeps a copy of the one its query
    head reads. Read from a Hugging Face directory, each rank reads exactly the elements it keeps
    and holds one process's values there; drawn from the seed (`drawn_for_generation`, as bench's
    --tensor-parallel models are) likewise; the engine's KV cache holds one head a layer, and
    greedy and sampled generation give one process's tokens."""
    from moemesh.checkpoint import lazy
    from moemesh.config import load_config
    from moemesh.inference.generate import drawn_for_generation, load_for_generation
    from moemesh.parallel.pieces import full_index

    mesh = init_mesh(ParallelDims(tp=4))
    read = []
    box = lazy.Stored._box
    lazy.Stored._box = lambda self, boxes: read.append(box(self, boxes).numel()) or box(self, boxes)
    try:
        model, _ = load_for_generation(hf_dir, "bytes", mesh=mesh)
    finally:
        lazy.Stored._box = box
    assert sum(read) == sum({t.data_ptr(): t.numel() for t in model.state_dict().values()}.values())
    run = load_config(config_file, launched=False)
    drawn, _ = drawn_for_generation(config_file, mesh=mesh)
    for laid_out, whole in [(model, build(CONFIG, seed=5)), (drawn, build(run.model, seed=run.train.seed))]:
        expected = dict(whole.named_parameters())
        for name, param in laid_out.named_parameters():
            block = torch.meshgrid(*full_index(param), indexing="ij")
            assert torch.equal(param.detach(), expected[name].detach()[block]), name
    head_dim = CONFIG.attention_head_dim
    assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == head_dim  # one head, copied

    tokenizer = ByteTokenizer()
    reference = DecodeEngine(build(CONFIG, seed=5).eval(), max_batch=2, max_len=32)
    expected = generate(reference, tokenizer, PROMPTS, PARAMS)
    engine = DecodeEngine(model, max_batch=2, max_len=32, group=mesh.group("tp"))
    if not engine.leader:
        engine.follow()
        return True
    results = generate(engine, tokenizer, PROMPTS, PARAMS)
    assert engine.cache.keys[0].shape[1:] == (1, head_dim)
    engine.close()
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    return True


def test_copied_key_value_heads_read_drawn_and_generated_per_rank(tmp_path):
    save_pretrained(build(CONFIG, seed=5), tmp_path / "hf")
    model_keys = "\n".join(f"{key} = {json.dumps(value)}" for key, value in TINY_MODEL.items())
    (tmp_path / "run.toml").write_text(f"[model]\n{model_keys}\n\n[train]\nseed = 7\nseq_len = 32\n")
    pool = WorkerPool(4)
    try:
        pool.run(check_copied_key_value_heads, str(tmp_path / "hf"), str(tmp_path / "run.toml"))
    finally:
        pool.close()


@pytest.mark.parametrize(
    "source, layout, ranks",
    [
        ("checkpoint", "tp", TP),
        ("config", "tp", TP),
        ("checkpoint", "ep", TP),
        ("checkpoint", "tp", 4),
        ("checkpoint", "tp,ep", TP),
    ],
    ids=["checkpoint-tp2", "config-tp2", "checkpoint-ep2", "checkpoint-tp4", "checkpoint-tp2-whole-experts"],
)
def test_generate_command_under_torchrun(tmp_path, capsys, source, layout, ranks):
    """From a checkpoint every rank reads its shard; from a config (weights drawn from the seed,
    for measuring a model no checkpoint holds yet) every rank draws its shard; under --tp its
    heads, expert slices and vocabulary, under --ep its experts, under both (one size) its heads,
    vocabulary and whole experts. Either way the text of one process. --tp 4: the 2 key/value
    heads copied on 2 ranks each, read from a DCP checkpoint."""
    if source == "checkpoint":
        model = build(CONFIG, seed=5)
        save_pretrained(model, tmp_path / "hf")
        assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "checkpoint")]) == 0  # every rank loads it
        given = ["--checkpoint", str(tmp_path / "checkpoint")]
    else:
        model_keys = "\n".join(f"{key} = {json.dumps(value)}" for key, value in TINY_MODEL.items())
        model_keys += "\ninitializer_range = 0.2"  # CONFIG's
        (tmp_path / "run.toml").write_text(f"[model]\n{model_keys}\n\n[train]\nseed = 5\nseq_len = 32\n")
        given = ["--config", str(tmp_path / "run.toml")]
    capsys.readouterr()
    args = ["generate", *given, "--prompt", "def ", "--max-new-tokens", "24"]
    assert main(args) == 0
    expected = capsys.readouterr().out
    assert len(expected) > len("def \n")

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(ranks),
            "-m",
            "moemesh",
            *args,
            "--set",
            *(f"parallel.{axis}={ranks}" for axis in layout.split(",")),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout == expected  # rank 0 alone prints, the same text


def test_generate_refuses_a_layout_torchrun_did_not_launch(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert (
        "parallel layout pp=1 × dp_replicate=1 × dp_shard=1 × ep=1 × tp=3 needs 3 processes, but 1 were launched" in err
    )


def test_generate_refuses_tp_and_ep_of_two_sizes(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--tp", "2", "--ep", "4"]) == 2
    assert "--tp N --ep N splits attention and experts over the same N ranks" in capsys.readouterr().err


def test_generate_from_a_config_takes_no_adapter(tmp_path, capsys):
    args = ["generate", "--config", "configs/tiny.toml", "--adapter", str(tmp_path), "--prompt", "x"]
    assert main(args) == 2
    assert "--adapter needs the --checkpoint of its base model, not --config" in capsys.readouterr().err


def test_generate_set_takes_only_the_tensor_parallel_size(tmp_path, capsys):
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "x", "--set", "train.steps=3"]) == 2
    assert "generate --set takes only parallel.tp=N or parallel.ep=N" in capsys.readouterr().err
