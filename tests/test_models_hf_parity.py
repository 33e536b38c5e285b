"""moemesh models against transformers, the numerical oracle: tiny random models built locally,
fp32 on CPU. Logits, loss, aux loss and every parameter gradient must agree.

Tolerance: 1e-5 relative (‖ours − theirs‖ / ‖theirs‖). Both sides compute the same fp32 function
with different operation orders (grouped expert loop vs transformers' per-expert masks), which
leaves differences near 1e-7; 1e-5 leaves room for accumulation over layers, and any real bug
(a wrong routing weight, a missed renormalisation, a mis-mapped expert) is orders larger."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from hf_oracle import assert_same_gradients, batch, compare_with_transformers, gradients, save_round_trip
from moemesh.checkpoint.load import from_pretrained
from moemesh.errors import CheckpointError, ConfigError
from moemesh.models import ModelConfig
from numerics import rel_err

RTOL = 1e-5

TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.1,
    router_aux_loss_coef=0.02,
)

CASES = {
    # experts not a power of two, head_dim != hidden/heads, a dense layer in the middle
    "qwen3_e6_k2_headdim_dense": (
        "qwen3_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=2,
            head_dim=12,
            norm_topk_prob=False,
            mlp_only_layers=[1],
            intermediate_size=40,
            moe_intermediate_size=16,
        ),
    ),
    # top-1, renormalised, dense layers by sparse step, tied embeddings, non-default rope theta
    "qwen3_e5_k1_norm_tied_step2": (
        "qwen3_moe",
        dict(
            num_experts=5,
            num_experts_per_tok=1,
            norm_topk_prob=True,
            decoder_sparse_step=2,
            tie_word_embeddings=True,
            intermediate_size=24,
            moe_intermediate_size=20,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
        ),
    ),
    # top-3 with attention bias
    "qwen3_e7_k3_norm_bias": (
        "qwen3_moe",
        dict(num_experts=7, num_experts_per_tok=3, norm_topk_prob=True, attention_bias=True, moe_intermediate_size=12),
    ),
    # a sliding window shorter than the sequence
    "qwen3_sliding_window": (
        "qwen3_moe",
        dict(num_experts=4, num_experts_per_tok=2, use_sliding_window=True, sliding_window=4, moe_intermediate_size=8),
    ),
    "mixtral_e5_k2": ("mixtral", dict(num_local_experts=5, num_experts_per_tok=2, intermediate_size=20)),
    "mixtral_e6_k3_tied": (
        "mixtral",
        dict(num_local_experts=6, num_experts_per_tok=3, intermediate_size=12, tie_word_embeddings=True, head_dim=16),
    ),
}


def hf_model(model_type: str, overrides: dict, seed: int = 0):
    torch.manual_seed(seed)
    config_cls, model_cls = {
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[model_type]
    config = config_cls(**TINY, **overrides)
    return model_cls(config).float().eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_aux_and_every_gradient_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    theirs = hf_model(model_type, overrides, seed=len(case))
    ours, out, ref = compare_with_transformers(theirs, tmp_path, len(case) + 1, RTOL, aux=True)

    ref.loss.backward()
    out.loss.backward()
    assert_same_gradients(gradients(ours), gradients(theirs), RTOL)


def test_router_gradient_comes_from_both_the_loss_and_the_aux_loss(tmp_path):
    """Without the aux loss the router still learns through the routing weights; with it, the
    gradient changes. Both must match transformers."""
    model_type, overrides = CASES["qwen3_e6_k2_headdim_dense"]
    theirs = hf_model(model_type, overrides)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    input_ids, labels = batch(theirs.config.vocab_size, seed=3)
    router = "model.layers.0.mlp.gate.weight"
    grads = []
    for with_aux in (False, True):
        for model in (theirs, ours):
            model.zero_grad()
            if model is ours:
                model(input_ids, labels=labels, output_router_logits=with_aux).loss.backward()
            else:
                model(input_ids=input_ids, labels=labels, output_router_logits=with_aux).loss.backward()
            grads.append(dict(model.named_parameters())[router].grad.clone())
    theirs_plain, ours_plain, theirs_aux, ours_aux = grads
    assert rel_err(ours_plain, theirs_plain) <= RTOL
    assert rel_err(ours_aux, theirs_aux) <= RTOL
    assert rel_err(theirs_aux, theirs_plain) > 1e-3  # the aux term really contributes


@pytest.mark.parametrize("case", ["qwen3_e5_k1_norm_tied_step2", "mixtral_e5_k2", "qwen3_e6_k2_headdim_dense"])
def test_save_pretrained_loads_in_transformers_with_the_same_logits(case, tmp_path):
    save_round_trip(hf_model(*CASES[case], seed=7), tmp_path, RTOL)


def test_sharded_index_and_fused_expert_layout_load(tmp_path):
    """transformers may write shards with an index, and the fused expert layout of its own
    modules; both load to the same model."""
    theirs = hf_model(*CASES["mixtral_e5_k2"], seed=2)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = from_pretrained(tmp_path / "sharded")

    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    (fused_dir / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, fused_dir / "model.safetensors")
    fused = from_pretrained(fused_dir)
    for (name, p), (_, q) in zip(sharded.state_dict().items(), fused.state_dict().items()):
        assert torch.equal(p, q), name
        assert torch.equal(p, theirs.state_dict()[name]), name


def test_dtype_argument_and_config_dtype(tmp_path):
    theirs = hf_model(*CASES["mixtral_e5_k2"])
    theirs.save_pretrained(tmp_path)
    assert from_pretrained(tmp_path).lm_head.weight.dtype == torch.float32
    assert from_pretrained(tmp_path, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16


# ---- clear errors ----------------------------------------------------------------------------------


def _saved(tmp_path, case="qwen3_e6_k2_headdim_dense"):
    hf_model(*CASES[case]).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_unknown_model_type_is_named(tmp_path):
    config = _saved(tmp_path)
    config["model_type"] = "qwen3_mo"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"unknown model_type 'qwen3_mo'.*did you mean 'qwen3_moe'"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "key, message",
    [
        ("model.layers.2.self_attn.k_norm.weight", r"missing weight 'model.layers.2.self_attn.k_norm.weight'"),
        ("model.layers.0.mlp.experts.4.up_proj.weight", r"missing weight model.layers.0.mlp.experts.4.up_proj.weight"),
    ],
)
def test_missing_weight_is_named(tmp_path, key, message):
    from safetensors.torch import load_file

    _saved(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors[key]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(tmp_path)


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    config = _saved(tmp_path)
    config["moe_intermediate_size"] = 17
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError,
        match=r"'model.layers.0.mlp.experts.gate_up_proj' has shape "
        r"\(6, 32, 32\), the config expects \(6, 34, 32\)",
    ):
        from_pretrained(tmp_path)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a Hugging Face model directory"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_experts_per_tok", 9, r"num_experts_per_tok \(9\) must be <= num_experts \(8\)"),
        ("num_key_value_heads", 3, r"multiple of num_key_value_heads"),
        ("hidden_act", "gelu", r"hidden_act 'gelu' is not supported"),
    ],
)
def test_invalid_config_values(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("case", ["qwen3_e6_k2_headdim_dense", "mixtral_e6_k3_tied"])
def test_triton_kernels_and_fused_loss_match_transformers(case, tmp_path, monkeypatch):
    """The training path: Triton permute/SwiGLU/combine/RMSNorm (interpreted on CPU) and the fused linear
    cross-entropy that never builds the logits."""
    monkeypatch.setenv("MOEMESH_KERNELS", "triton")
    model_type, overrides = CASES[case]
    theirs = hf_model(model_type, overrides, seed=11)
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    input_ids, labels = batch(theirs.config.vocab_size, seed=12)
    ref = theirs(input_ids=input_ids, labels=labels, output_router_logits=True)
    out = ours(input_ids, labels=labels, output_router_logits=True, return_logits=False)
    assert out.logits is None
    assert abs(out.loss.item() - ref.loss.item()) <= RTOL * abs(ref.loss.item())
    ref.loss.backward()
    out.loss.backward()
    ours_params = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert rel_err(ours_params[name].grad, p.grad) <= RTOL, name
