"""GPT-OSS against transformers' GptOssForCausalLM: tiny random models built locally, fp32 on CPU.
Logits, loss, aux loss and every parameter gradient (mapped to moemesh's expert layout by the
family's own checkpoint conversion) must agree; checkpoints go both ways.

Tolerance: 1e-5 relative (‖ours − theirs‖ / ‖theirs‖). Both sides compute the same fp32 function
in different operation orders (grouped expert loop and softmax -> top-k -> renormalise here,
per-expert masks and top-k -> softmax there), which leaves differences near 1e-7; a wrong clamp,
a bias added twice, a mis-interleaved gate/up column or a missing sink is orders larger."""

import pytest
import torch
import transformers

from hf_oracle import assert_same_gradients, batch, compare_with_transformers, gradients, save_round_trip
from moemesh.models.registry import family
from numerics import rel_err

RTOL = 1e-5

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    initializer_range=0.1,
    router_aux_loss_coef=0.02,
    sliding_window=4,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
)

CASES = {
    # a limit small enough that both clamps bite; odd expert count
    "e5_k2_clamped": dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=20, swiglu_limit=0.4),
    # top-3, tied embeddings, explicit layer types, no attention bias
    "e6_k3_tied_types": dict(
        num_local_experts=6,
        num_experts_per_tok=3,
        intermediate_size=12,
        swiglu_alpha=1.3,
        tie_word_embeddings=True,
        attention_bias=False,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
    ),
}


def hf_model(overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**TINY, **overrides)).float().eval()
    with torch.no_grad():  # transformers starts the expert biases at zero: make them count
        for name, param in model.named_parameters():
            if "bias" in name or name.endswith("sinks"):
                param.normal_(0.0, 0.3)
    return model


def as_ours(tensors: dict, config) -> dict:
    return family("gpt_oss").state_from_hf(tensors, config)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_aux_and_every_gradient_match_transformers(case, tmp_path):
    theirs = hf_model(CASES[case], seed=len(case))
    ours, out, ref = compare_with_transformers(theirs, tmp_path, len(case) + 1, RTOL, aux=True)

    ref.loss.backward()
    out.loss.backward()
    assert_same_gradients(gradients(ours), as_ours(gradients(theirs), ours.config), RTOL)


def test_attention_in_chunks_of_queries_matches_transformers(monkeypatch, tmp_path):
    """The eager attention with sinks bounds the scores it holds (layers.SCORES_AT_ONCE): with a
    bound of one score, every query row goes alone, and logits and gradients still agree."""
    from moemesh.models import layers

    monkeypatch.setattr(layers, "SCORES_AT_ONCE", 1)
    theirs = hf_model(CASES["e5_k2_clamped"], seed=3)
    ours, out, ref = compare_with_transformers(theirs, tmp_path, 4, RTOL, aux=True)
    ref.loss.backward()
    out.loss.backward()
    assert_same_gradients(gradients(ours), as_ours(gradients(theirs), ours.config), RTOL)


def test_clamp_and_sinks_matter():
    """The test cases exercise what they claim: some gate/up values pass the limit, and the sinks
    change the output (a model without them would fail the parity test)."""
    theirs = hf_model(CASES["e5_k2_clamped"])
    x = theirs.model.embed_tokens(batch(96, 0)[0]).flatten(0, 1)
    experts = theirs.model.layers[0].mlp.experts
    gate_up = x @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
    assert (gate_up.abs() > theirs.config.swiglu_limit).float().mean() > 0.05
    input_ids, _ = batch(96, 1)
    with torch.no_grad():
        before = theirs(input_ids=input_ids).logits
        for layer in theirs.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        assert rel_err(theirs(input_ids=input_ids).logits, before) > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_loads_in_transformers_with_the_same_logits(case, tmp_path):
    theirs = hf_model(CASES[case], seed=7)
    _, reloaded, written = save_round_trip(theirs, tmp_path, RTOL)
    assert reloaded.config.layer_types == theirs.config.layer_types
    assert reloaded.config.swiglu_limit == theirs.config.swiglu_limit
    assert written["model_type"] == "gpt_oss" and "attention_sinks" not in written
