"""Tensor and expert parallelism of the families beyond Qwen3/Mixtral, on 4 CPU processes (gloo),
fp32, against one process.

As in test_parallel_tensor.py: every rank builds the full model from the same seed, computes the
single-process reference itself, shards it (TP over 4 ranks, 2 data-parallel replicas × TP 2,
EP over 4, EP 2 × TP 2) and compares loss, aux loss, logits (this rank's vocabulary slice) and
every gradient (sliced to this rank's shard). Tolerance 1e-5 relative: the sharded run adds the
same fp32 terms in another order (partial sums per rank), which moves results by ~1e-7; a bias
counted tp times or a sink on the wrong head is orders larger."""

import pytest
import torch

from moemesh.models import ModelConfig, build
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel, label_tokens, rank_loss, reduce_gradients
from moemesh.parallel.expert import apply_ep, is_expert_parameter
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp
from numerics import rel_err

WORLD = 4
RTOL = 1e-5
# GPT-OSS: biases everywhere (router, experts, attention), sinks, sliding window on two layers,
# a SwiGLU limit small enough to clamp.
GPT_OSS = ModelConfig(model_type="gpt_oss", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=16, sliding_window=4, attention_bias=True,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      swiglu_alpha=1.702, swiglu_limit=0.5, initializer_range=0.2, router_aux_loss_coef=0.05,
                      output_router_logits=True)
# DeepSeek V3: latent attention with a q latent, a dense first layer, shared experts, sigmoid
# group-limited routing with a (non-zero) correction bias, interleaved rope.
DEEPSEEK_V3 = ModelConfig(model_type="deepseek_v3", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=8, num_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=16, intermediate_size=24, q_lora_rank=12, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=6, v_head_dim=10, head_dim=6, rope_interleave=True,
                          n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
                          norm_topk_prob=True, routed_scaling_factor=2.5, attention_bias=True,
                          initializer_range=0.2, router_aux_loss_coef=0.05, output_router_logits=True)
# DeepSeek V2-Lite style: a full-rank q_proj, softmax group-limited greedy routing.
DEEPSEEK_V2 = DEEPSEEK_V3.replace(model_type="deepseek_v2", q_lora_rank=None, topk_method="group_limited_greedy",
                                  attention_bias=False, routed_scaling_factor=1.5)
# Gemma 4: a dense GeGLU MLP beside every expert block, per-head q/k/v norms, a full layer with a
# wider head and proportional rope, soft-capped logits.
GEMMA4 = ModelConfig(model_type="gemma4_text", vocab_size=64, hidden_size=32, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=4, head_dim=4, global_head_dim=8,
                     num_experts=8, num_experts_per_tok=3,
                     moe_intermediate_size=16, intermediate_size=24, hidden_act="gelu_pytorch_tanh", sliding_window=4,
                     layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                     full_attention_rope={"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                          "rope_theta": 1000.0},
                     final_logit_softcapping=5.0, initializer_range=0.2, router_aux_loss_coef=0.05,
                     output_router_logits=True)
CONFIGS = {"gpt_oss": GPT_OSS, "deepseek_v3": DEEPSEEK_V3, "deepseek_v2": DEEPSEEK_V2, "gemma4": GEMMA4}


def micro_batch(seed=0, batch=4, seq=9):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 64, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[1, 2:5] = -100
    return input_ids, labels


def build_with_biases(config):
    """The model with non-zero biases and sinks (biases start at zero), so that a bias added on
    every rank, or a sink on the wrong head, would show; likewise V3's correction bias."""
    model = build(config, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "sinks")):
                tensor.normal_(0.0, 0.2, generator=generator)
    return model


def tp_slice(name: str, full: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of a full parameter (or gradient), written out independently of the plans."""
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # matching gate and up slices
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                      "experts.down_proj")):
        return full.chunk(tp, dim=-1)[rank]
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
                      "self_attn.sinks", "q_b_proj.weight", "kv_b_proj.weight", "gate_proj.weight", "up_proj.weight",
                      "embed_tokens.weight", "lm_head.weight")):
        return full.chunk(tp, dim=0)[rank]
    return full  # norms, router, o_proj bias, experts' down_proj_bias, latent projections: whole on every rank


def check_matches_single_process(rank, family, dp, ep, tp):
    config = CONFIGS[family]
    input_ids, labels = micro_batch(seed=dp * 10 + ep * 3 + tp, batch=4 * dp * ep)
    reference = build_with_biases(config)
    ref_out = reference(input_ids, labels=labels)
    ref_out.loss.backward()

    mesh = init_mesh(ParallelDims(dp_replicate=dp, ep=ep, tp=tp))
    model = apply_data_parallel(apply_tp(apply_ep(build_with_biases(config), mesh), mesh), mesh)
    tp_rank, ep_rank, batch_rank = mesh.rank("tp"), mesh.rank("ep"), mesh.rank("batch")
    rows = input_ids.shape[0] // (dp * ep)
    local = slice(batch_rank * rows, (batch_rank + 1) * rows)
    out = model(input_ids[local], labels=labels[local])
    loss = rank_loss(out.ce_loss, out.aux_loss, label_tokens(labels[local]), label_tokens(labels),
                     config.router_aux_loss_coef, dp * ep)
    loss.backward()
    reduce_gradients(model, mesh)
    comm.all_reduce_sum_([summed := loss.detach().clone()], mesh.group("batch"))

    assert rel_err(summed, ref_out.loss.detach()) <= RTOL
    assert rel_err(out.aux_loss, ref_out.aux_loss) <= RTOL
    ref_logits = ref_out.logits[local].detach().movedim(-1, 0)  # vocabulary first, as in lm_head.weight
    assert rel_err(out.logits, tp_slice("lm_head.weight", ref_logits, tp_rank, tp).movedim(0, -1)) <= RTOL
    ref_params = dict(reference.named_parameters())
    local_experts = config.num_experts // ep
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        if is_expert_parameter(name):
            expected = expected[ep_rank * local_experts:(ep_rank + 1) * local_experts]
        expected = tp_slice(name, expected, tp_rank, tp)
        assert param.shape == expected.shape, name
        assert param.grad is not None and expected.norm() > 0, name
        assert rel_err(param.grad, expected) <= RTOL, name
    return True


LAYOUTS = [(1, 1, 4), (2, 1, 2), (1, 4, 1), (2, 2, 1), (1, 2, 2)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.parametrize("dp, ep, tp", LAYOUTS, ids=["tp4", "dp2-tp2", "ep4", "dp2-ep2", "ep2-tp2"])
def test_layout_equals_one_process(pool, family, dp, ep, tp):
    assert all(pool.run(check_matches_single_process, family, dp, ep, tp))


def check_one_reduce_per_moe_block(rank, family):
    """The MoE block issues exactly one forward all-reduce of [tokens, hidden] — DeepSeek's
    shared experts included — and matches one process."""
    mesh = init_mesh(ParallelDims(tp=WORLD))
    config = CONFIGS[family].replace(num_hidden_layers=1, first_k_dense_replace=0, layer_types=None)
    reference = build_with_biases(config).model.layers[0].mlp
    block = apply_tp(build_with_biases(config), mesh).model.layers[0].mlp
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(4))
    comm.reset_counts()
    out = block(x)[0]
    assert dict(comm.calls) == {("all_reduce", "forward"): 1}
    assert comm.sent_bytes[("all_reduce", "forward")] == x.numel() * 4
    assert rel_err(out, reference(x)[0]) <= RTOL
    return True


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_one_reduce_per_moe_block(pool, family):
    assert all(pool.run(check_one_reduce_per_moe_block, family))


def check_gpt_oss_down_bias_counted_once(rank):
    """The experts' down_proj_bias is added to the partial outputs, before the block's one
    all-reduce: each rank adds bias / tp. The block issues exactly one forward all-reduce of
    [tokens, hidden], matches one process, and would not if every rank added the whole bias."""
    mesh = init_mesh(ParallelDims(tp=WORLD))
    config = GPT_OSS.replace(num_hidden_layers=1, layer_types=["full_attention"])
    reference = build_with_biases(config).model.layers[0].mlp
    block = apply_tp(build_with_biases(config), mesh).model.layers[0].mlp
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(4))
    comm.reset_counts()
    out = block(x)[0]
    assert dict(comm.calls) == {("all_reduce", "forward"): 1}
    assert comm.sent_bytes[("all_reduce", "forward")] == x.numel() * 4
    expected = reference(x)[0]
    assert rel_err(out, expected) <= RTOL
    block.experts.down_bias_share = 1.0  # every rank adding the whole bias: counted tp times
    assert rel_err(block(x)[0], expected) > 1e-2
    return True


def test_gpt_oss_down_bias_counted_once_with_one_reduce_per_block(pool):
    assert all(pool.run(check_gpt_oss_down_bias_counted_once))


def check_checkpoint_pieces(rank, family, layout: dict):
    """Every tensor, as a checkpoint stores it (`stored_state`), gathered whole from this layout's
    shards equals the one-process model's — so a checkpoint moves between layouts. Under FSDP too."""
    from torch.distributed.tensor import DTensor

    from moemesh.parallel.fsdp import apply_fsdp
    from moemesh.parallel.stored import stored_state
    from test_parallel_fsdp import presented

    config = CONFIGS[family]
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
@pytest.mark.parametrize("layout", [dict(tp=4), dict(ep=2, tp=2), dict(dp_shard=2, tp=2), dict(dp_shard=2, ep=2)],
                         ids=["tp4", "ep2-tp2", "dp_shard2-tp2", "dp_shard2-ep2"])
def test_checkpoint_pieces_equal_one_process(pool, family, layout):
    assert all(pool.run(check_checkpoint_pieces, family, layout))
