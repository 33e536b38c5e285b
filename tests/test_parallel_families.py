"""Tensor and expert parallelism of the families beyond Qwen3/Mixtral, on 4 CPU processes (gloo),
fp32, against one process.

With test_parallel_tensor.py's check: every rank builds the full model from the same seed, computes the
single-process reference itself, shards it (TP over 4 ranks, 2 data-parallel replicas × TP 2,
EP over 4, EP 2 × TP 2) and compares loss, aux loss, logits (this rank's vocabulary slice) and
every gradient (sliced to this rank's shard). Tolerance 1e-5 relative: the sharded run adds the
same fp32 terms in another order (partial sums per rank), which moves results by ~1e-7; a bias
counted tp times or a sink on the wrong head is orders larger."""

import pytest
import torch

from moemesh.errors import ConfigError
from moemesh.models import ModelConfig
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel
from moemesh.parallel.expert import apply_ep
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp
from numerics import rel_err
from test_parallel_tensor import build_with_biases, check_matches_single_process

WORLD = 4
RTOL = 1e-5
# GPT-OSS: biases everywhere (router, experts, attention), sinks, sliding window on two layers,
# a SwiGLU limit small enough to clamp.
GPT_OSS = ModelConfig(
    model_type="gpt_oss",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    sliding_window=4,
    attention_bias=True,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    swiglu_alpha=1.702,
    swiglu_limit=0.5,
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)
# DeepSeek V3: latent attention with a q latent, a dense first layer, shared experts, sigmoid
# group-limited routing with a (non-zero) correction bias, interleaved rope.
DEEPSEEK_V3 = ModelConfig(
    model_type="deepseek_v3",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=8,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    intermediate_size=24,
    q_lora_rank=12,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    head_dim=6,
    rope_interleave=True,
    n_shared_experts=2,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    attention_bias=True,
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)
# DeepSeek V2-Lite style: a full-rank q_proj, softmax group-limited greedy routing.
DEEPSEEK_V2 = DEEPSEEK_V3.replace(
    model_type="deepseek_v2",
    q_lora_rank=None,
    topk_method="group_limited_greedy",
    attention_bias=False,
    routed_scaling_factor=1.5,
)
# Gemma 4: a dense GeGLU MLP beside every expert block, per-head q/k/v norms, a full layer with a
# wider head and proportional rope, soft-capped logits.
GEMMA4 = ModelConfig(
    model_type="gemma4_text",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=4,
    global_head_dim=8,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    intermediate_size=24,
    hidden_act="gelu_pytorch_tanh",
    sliding_window=4,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    full_attention_rope={"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
    final_logit_softcapping=5.0,
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)
CONFIGS = {"gpt_oss": GPT_OSS, "deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "gemma4": GEMMA4}
# Gemma 4 26B-A4B's shape, tiny: the full layer's values are its keys (attention_k_eq_v, no
# v_proj), with 2 key/value heads of their own size beside the sliding layers' 4 — TP=2 splits
# them, TP=4 copies each on 2 ranks (the sliding layers' 4 split).
GEMMA4_26B_A4B = GEMMA4.replace(attention_k_eq_v=True, num_global_key_value_heads=2)


LAYOUTS = [(1, 1, 4), (2, 1, 2), (1, 4, 1), (2, 2, 1), (1, 2, 2)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dp, ep, tp", LAYOUTS, ids=["tp4", "dp2-tp2", "ep4", "dp2-ep2", "ep2-tp2"])
def test_layout_equals_one_process(pool, family, dp, ep, tp):
    assert all(pool.run(check_matches_single_process, CONFIGS[family], dp, ep, tp))


def feed_forward(layer, x):
    """Layer `layer`'s MoE block on tokens x — with Gemma 4's dense MLP beside it, both branches
    and their norms (`aggregate`, x standing in for the residual)."""
    out = layer.mlp(x)[0]
    return layer.aggregate(x, out) if hasattr(layer, "reduce_branches") else out


def one_reduce_block(config, tp=WORLD):
    """Layer 0's MoE block under TP (over all ranks, or replicas of tp ranks): its output for a
    batch of tokens, the block, the tokens and the one-process block's output. The block must
    issue exactly one forward all-reduce of [tokens, hidden] and match one process; Gemma 4's
    layer one of [2, tokens, hidden] for its dense MLP and its experts together."""
    mesh = init_mesh(ParallelDims(dp_replicate=WORLD // tp, tp=tp))
    reference = build_with_biases(config).model.layers[0]
    layer = apply_tp(build_with_biases(config), mesh).model.layers[0]
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(4))
    comm.reset_counts()
    out = feed_forward(layer, x)
    branches = 2 if hasattr(layer, "reduce_branches") else 1
    assert dict(comm.calls) == {("all_reduce", "forward"): 1}
    assert comm.sent_bytes[("all_reduce", "forward")] == branches * x.numel() * 4
    expected = feed_forward(reference, x)
    assert rel_err(out, expected) <= RTOL
    return layer.mlp, x, expected


def check_one_reduce_per_moe_block(rank, family):
    """One forward all-reduce per MoE block, DeepSeek's shared experts included, Gemma 4's dense
    MLP too."""
    one_reduce_block(CONFIGS[family].replace(num_hidden_layers=1, first_k_dense_replace=0, layer_types=None))
    return True


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_one_reduce_per_moe_block(pool, family):
    assert all(pool.run(check_one_reduce_per_moe_block, family))


def check_gpt_oss_down_bias_counted_once(rank):
    """The experts' down_proj_bias is added to the partial outputs, before the block's one
    all-reduce: each rank adds bias / tp. It matches one process, and would not if every rank
    added the whole bias."""
    block, x, expected = one_reduce_block(GPT_OSS.replace(num_hidden_layers=1, layer_types=["full_attention"]))
    block.experts.down_bias_share = 1.0  # every rank adding the whole bias: counted tp times
    assert rel_err(block(x)[0], expected) > 1e-2
    return True


def test_gpt_oss_down_bias_counted_once_with_one_reduce_per_block(pool):
    assert all(pool.run(check_gpt_oss_down_bias_counted_once))


@pytest.mark.parametrize("dp, ep, tp", [(2, 1, 2), (1, 2, 2), (1, 1, 4)], ids=["dp2-tp2", "ep2-tp2", "tp4"])
def test_gemma4_26b_a4b_shape_equals_one_process(pool, dp, ep, tp):
    """Loss, logits and every gradient, the shared k/v projection's included; under TP 4 the full
    layer's 2 key/value heads are each copied on 2 ranks, their gradients (and the k norm's)
    summed over the copies."""
    assert all(pool.run(check_matches_single_process, GEMMA4_26B_A4B, dp, ep, tp))


def check_gemma4_26b_a4b_decoding(rank, tp):
    """Greedy and sampled decoding of a batch under TP=2 (two replicas of 2 ranks) or TP=4 (the
    full layer's 2 key/value heads copied on 2 ranks each) equals one process; the MoE block
    reduces once, after the per-expert scales in the routing weights. Each rank's KV cache holds
    its attention's key/value heads: the full layer's one (copied or split), the sliding layers'
    4 / tp."""
    from moemesh.data.tokenizer import ByteTokenizer
    from moemesh.inference.engine import DecodeEngine
    from moemesh.inference.generate import generate
    from moemesh.inference.request import SamplingParams

    config = GEMMA4_26B_A4B.replace(vocab_size=256)
    one_reduce_block(config.replace(num_hidden_layers=1, layer_types=None), tp=tp)
    prompts = [[0, 100, 101, 102], [0, 7], [0, *range(40, 49)]]
    params = [
        SamplingParams(max_tokens=10),
        SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3),
        SamplingParams(max_tokens=6),
    ]
    expected = generate(
        DecodeEngine(build_with_biases(config).eval(), max_batch=2, max_len=32), ByteTokenizer(), prompts, params
    )
    mesh = init_mesh(ParallelDims(dp_replicate=WORLD // tp, tp=tp))
    engine = DecodeEngine(
        apply_tp(build_with_biases(config), mesh).eval(), max_batch=2, max_len=32, group=mesh.group("tp")
    )
    attention = [layer.self_attn for layer in engine.model.model.layers]
    assert [a.num_kv_heads for a in attention] == [4 // tp, 1, 4 // tp]  # the full layer's 2: split, or copied
    if not engine.leader:
        engine.follow()
        return True
    results = generate(engine, ByteTokenizer(), prompts, params)
    assert [engine.cache.keys[i].shape[1] for i in range(3)] == [a.num_kv_heads for a in attention]
    engine.close()
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_gemma4_26b_a4b_shape_decodes_as_one_process(pool, tp):
    assert all(pool.run(check_gemma4_26b_a4b_decoding, tp))


def check_refuses_tp_that_neither_splits_nor_copies_the_heads(rank):
    """3 key/value heads on the full layer over 4 ranks: neither split nor each copied on whole
    ranks. The message names the count and the layer."""
    mesh = init_mesh(ParallelDims(tp=4))
    config = GEMMA4_26B_A4B.replace(num_global_key_value_heads=3)
    with pytest.raises(
        ConfigError,
        match=r"parallel.tp=4 must divide the 3 key/value attention heads or be a multiple of them \(layer 1\)",
    ):
        apply_tp(build_with_biases(config), mesh)
    return True


def test_refuses_tp_that_neither_splits_nor_copies_the_key_value_heads(pool):
    assert all(pool.run(check_refuses_tp_that_neither_splits_nor_copies_the_heads))


def check_checkpoint_pieces(rank, config, layout: dict):
    """Every tensor, as a checkpoint stores it (`stored_state`), gathered whole from this layout's
    shards equals the one-process model's — so a checkpoint moves between layouts. Under FSDP too."""
    from torch.distributed.tensor import DTensor

    from moemesh.parallel.fsdp import apply_fsdp
    from moemesh.parallel.stored import stored_state
    from test_parallel_fsdp import presented

    mesh = init_mesh(ParallelDims(**layout))
    model = apply_data_parallel(apply_tp(apply_ep(build_with_biases(config), mesh), mesh), mesh)
    apply_fsdp(model, mesh)
    pieces = stored_state({"model": dict(model.named_parameters())}, model, mesh)["model"]
    expected = {}
    for name, param in build_with_biases(config).named_parameters():
        expected.update(presented(name, param.detach()))
    assert pieces.keys() == expected.keys()
    for key, piece in pieces.items():
        whole = piece.full_tensor() if isinstance(piece, DTensor) else piece
        assert torch.equal(whole.detach(), expected[key]), key
    return True


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize(
    "layout",
    [dict(tp=4), dict(ep=2, tp=2), dict(dp_shard=2, tp=2), dict(dp_shard=2, ep=2)],
    ids=["tp4", "ep2-tp2", "dp_shard2-tp2", "dp_shard2-ep2"],
)
def test_checkpoint_pieces_equal_one_process(pool, family, layout):
    assert all(pool.run(check_checkpoint_pieces, CONFIGS[family], layout))


@pytest.mark.parametrize(
    "config, layout",
    [(GEMMA4_26B_A4B, dict(tp=4)), (GEMMA4_26B_A4B.replace(num_global_key_value_heads=1), dict(dp_shard=2, tp=2))],
    ids=["gemma4_26b_a4b-tp4", "gemma4-1-kv-head-dp_shard2-tp2"],
)
def test_checkpoint_pieces_of_copied_key_value_heads(pool, config, layout):
    """The full layer's key/value heads, fewer than the tp ranks: each rank's copy presented as
    split over the heads and the same on the copies (under FSDP: a shard of it)."""
    assert all(pool.run(check_checkpoint_pieces, config, layout))
