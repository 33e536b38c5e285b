"""DeepSeek V2 and V3 against transformers: tiny random models built locally, fp32 on CPU.
Logits, loss and every parameter gradient must agree; checkpoints go both ways.

Tolerance: 1e-5 relative (‖ours − theirs‖ / ‖theirs‖). Both sides compute the same fp32 function
in different operation orders (grouped expert loop vs per-expert masks, de-interleaved vs complex
rotary pairs), which leaves differences near 1e-7; a wrong group mask, a correction bias used in
the weights, a missed scaling factor or a mis-rotated rope dim is orders larger.

transformers computes no load-balancing loss for these families; moemesh's (documented in
moemesh/models/deepseek.py) is checked against the routing transformers' own routers produce."""

import pytest
import torch
import transformers

from hf_oracle import assert_same_gradients, batch, compare_with_transformers, gradients, save_round_trip
from moemesh.checkpoint.load import from_pretrained
from numerics import rel_err

RTOL = 1e-5

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=40,
    moe_intermediate_size=12,
    initializer_range=0.1,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=6,
    v_head_dim=10,
    first_k_dense_replace=1,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)

CASES = {
    # V3: q latent, sigmoid scores, 4 groups of 2 choose 2, renormalised and scaled, interleaved rope
    "v3_groups": (
        "deepseek_v3",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            q_lora_rank=12,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_interleave=True,
        ),
    ),
    # V3 without interleave or renormalisation, two shared experts, tied embeddings
    "v3_plain_rope": (
        "deepseek_v3",
        dict(
            n_routed_experts=6,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            q_lora_rank=12,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            rope_interleave=False,
            tie_word_embeddings=True,
        ),
    ),
    # V2-Lite style: no q latent, greedy softmax top-k
    "v2_lite_greedy": (
        "deepseek_v2",
        dict(
            n_routed_experts=6,
            num_experts_per_tok=2,
            q_lora_rank=None,
            n_shared_experts=2,
            topk_method="greedy",
            routed_scaling_factor=1.0,
        ),
    ),
    # V2: group-limited greedy, scaled
    "v2_groups": (
        "deepseek_v2",
        dict(
            n_routed_experts=8,
            num_experts_per_tok=2,
            q_lora_rank=12,
            n_shared_experts=1,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.7,
        ),
    ),
}


def hf_model(model_type: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
    }[model_type]
    model = model_cls(config_cls(**TINY, **overrides)).float().eval()
    with torch.no_grad():  # a correction bias as large as the score spread changes the choice
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_every_gradient_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    theirs = hf_model(model_type, overrides, seed=len(case))
    ours, out, ref = compare_with_transformers(theirs, tmp_path, len(case) + 1, RTOL)

    ref.loss.backward()
    out.loss.backward()
    assert_same_gradients(gradients(ours), gradients(theirs), RTOL)


@pytest.mark.parametrize("case", ["v3_groups", "v2_groups"])
def test_aux_loss_is_the_switch_loss_of_transformers_routing(case, tmp_path):
    """E · Σ_e (share of token slots choosing e) · (mean normalised score of e), pooled over the
    MoE layers, from the expert choices and router logits transformers' routers produce."""
    model_type, overrides = CASES[case]
    theirs = hf_model(model_type, overrides, seed=3)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    input_ids, labels = batch(theirs.config.vocab_size, seed=4)
    routed = []
    for layer in theirs.model.layers[theirs.config.first_k_dense_replace :]:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: routed.append(out))
    with torch.no_grad():
        theirs(input_ids=input_ids)
    experts = theirs.config.n_routed_experts
    counts, probs = torch.zeros(experts), torch.zeros(experts)
    for logits, _, ids in routed:
        scores = logits.sigmoid() if model_type == "deepseek_v3" else logits.softmax(-1)
        probs += (scores / scores.sum(-1, keepdim=True)).sum(0)
        counts += torch.bincount(ids.flatten(), minlength=experts)
    tokens = len(routed) * input_ids.numel()
    expected = experts * ((counts / tokens) * (probs / tokens)).sum()

    out = ours(input_ids, labels=labels, output_router_logits=True)
    assert rel_err(out.aux_loss, expected) <= RTOL
    assert rel_err(out.loss, out.ce_loss + ours.config.router_aux_loss_coef * out.aux_loss) <= RTOL


def test_correction_bias_chooses_but_does_not_weigh(tmp_path):
    """The V3 case really depends on e_score_correction_bias (zeroing it changes the choice, and
    the logits), so the parity test above checks that it is used for the choice only."""
    theirs = hf_model(*CASES["v3_groups"], seed=5)
    input_ids, _ = batch(96, 6)
    with torch.no_grad():
        before = theirs(input_ids=input_ids).logits
        for name, buffer in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
        assert rel_err(theirs(input_ids=input_ids).logits, before) > 1e-4


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_loads_in_transformers_with_the_same_logits(case, tmp_path):
    theirs = hf_model(*CASES[case], seed=7)
    _, _, written = save_round_trip(theirs, tmp_path, RTOL)
    assert written["q_lora_rank"] == theirs.config.q_lora_rank
    assert "swiglu_limit" not in written and "layer_types" not in written


def test_a_model_built_in_bf16_keeps_the_correction_bias_fp32():
    """Built on the meta device under bf16 as the default dtype (the benches' 48-layer models, with
    no room for an fp32 copy): the bias is made on the device in fp32, at zero."""
    from moemesh.config import load_config
    from moemesh.models import build

    config = load_config("configs/deepseek_v3_small.toml", launched=False).model.replace(num_hidden_layers=4)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build(config, seed=0)
    finally:
        torch.set_default_dtype(previous)
    biases = [b for name, b in model.named_buffers() if name.endswith("e_score_correction_bias")]
    assert biases and all(b.dtype == torch.float32 and not b.any() for b in biases)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
