"""Scaled RoPE against transformers: YaRN's inverse frequencies and attention factor bit for bit
against `_compute_yarn_parameters` (proportional RoPE's against its own), then tiny random GPT-OSS,
DeepSeek V3/V2 and Qwen3-MoE models with yarn rope (and a Qwen3-MoE with proportional rope), fp32
on CPU: logits, loss and every gradient, checkpoints both ways.

The batch (hf_oracle.batch) has 11 positions, beyond original_max_position_embeddings = 4, and the
betas put a fractional step of the ramp on the few rotary dims of these tiny heads, so every part
of the blend is used. Tolerance 1e-5 relative, as in the per-family tests; a wrong frequency, an
attention factor left out or DeepSeek's softmax mscale missed is orders larger (checked below by
dropping the scaling)."""

import math
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import _compute_proportional_rope_parameters, _compute_yarn_parameters

from hf_oracle import assert_same_gradients, batch, compare_with_transformers, gradients, save_round_trip
from moemesh.checkpoint.load import from_pretrained
from moemesh.errors import ConfigError
from moemesh.models import ModelConfig
from moemesh.models.registry import family
from moemesh.models.rope import RotaryEmbedding, proportional, yarn
from numerics import rel_err

RTOL = 1e-5
THETA = 100.0
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 1.0,
    "beta_slow": 0.25,
    "truncate": False,
}
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    initializer_range=0.1,
    max_position_embeddings=16,
)

CASES = {
    "gpt_oss": (
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=12,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=16,
            sliding_window=6,
            rope_parameters=YARN,
        ),
    ),
    # mscale != mscale_all_dim: cos/sin scaled, and the softmax scale too
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        dict(
            num_key_value_heads=4,
            intermediate_size=40,
            moe_intermediate_size=12,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=10,
            first_k_dense_replace=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            q_lora_rank=12,
            rope_parameters={**YARN, "mscale": 1.3, "mscale_all_dim": 0.7, "truncate": True},
        ),
    ),
    # the old spelling (type), no factor: the ratio of the context lengths
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        transformers.DeepseekV2ForCausalLM,
        dict(
            num_key_value_heads=4,
            intermediate_size=40,
            moe_intermediate_size=12,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=10,
            n_routed_experts=6,
            num_experts_per_tok=2,
            q_lora_rank=None,
            n_shared_experts=1,
            rope_parameters={
                "type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # an explicit attention factor, transformers' default betas
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_experts=6,
            num_experts_per_tok=2,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 4,
                "attention_factor": 1.25,
            },
        ),
    ),
    # a quarter of the pairs rotated, all slowed by factor
    "qwen3_moe_proportional": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=40,
            moe_intermediate_size=12,
            num_experts=6,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},
        ),
    ),
}


def hf_model(case: str, seed: int = 0):
    config_cls, model_cls, overrides = CASES[case]
    overrides = dict(overrides, rope_parameters={**overrides["rope_parameters"], "rope_theta": THETA})
    torch.manual_seed(seed)
    return model_cls(config_cls(**COMMON, **overrides)).float().eval()


@pytest.mark.parametrize(
    "rope",
    [
        YARN,
        {**YARN, "truncate": True, "beta_fast": 8.0, "beta_slow": 0.5},
        {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 16},  # factor from the ratio
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },  # GPT-OSS's own
    ],
)
@pytest.mark.parametrize("dim", [8, 64])
def test_yarn_tables_equal_transformers(rope, dim):
    theta = 150000.0 if rope["original_max_position_embeddings"] == 4096 else THETA
    hf_config = SimpleNamespace(
        rope_parameters={**rope, "rope_theta": theta},
        head_dim=dim,
        hidden_size=dim,
        num_attention_heads=1,
        max_position_embeddings=64,
        standardize_rope_params=lambda: None,
    )
    expected_inv_freq, expected_factor = _compute_yarn_parameters(hf_config)
    inv_freq, factor = yarn(dim, theta, rope, max_position_embeddings=64)
    assert torch.equal(inv_freq, expected_inv_freq)
    assert factor == expected_factor
    plain = RotaryEmbedding(dim, theta).inv_freq
    assert not torch.allclose(inv_freq, plain)  # the scaling does something here


@pytest.mark.parametrize(
    "dim, rope", [(8, {"partial_rotary_factor": 0.25}), (12, {"partial_rotary_factor": 0.5, "factor": 3.0}), (16, {})]
)
def test_proportional_table_equals_transformers(dim, rope):
    rope = {"rope_type": "proportional", **rope}
    hf_config = SimpleNamespace(
        rope_parameters={**rope, "rope_theta": THETA}, head_dim=dim, standardize_rope_params=lambda: None
    )
    expected, factor = _compute_proportional_rope_parameters(hf_config)
    assert torch.equal(proportional(dim, THETA, rope), expected) and factor == 1.0


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_loss_and_every_gradient_match_transformers(case, tmp_path):
    theirs = hf_model(case, seed=len(case))
    ours, out, ref = compare_with_transformers(theirs, tmp_path, len(case) + 1, RTOL)
    rope = ours.config.rope_scaling
    assert rope["rope_type"] == theirs.config.rope_parameters["rope_type"] != "default"
    input_ids, _ = batch(theirs.config.vocab_size, len(case) + 1)  # the batch compared above
    assert input_ids.shape[1] > rope.get("original_max_position_embeddings", 0)  # so the scaling matters
    ref.loss.backward()
    out.loss.backward()
    theirs_grads = gradients(theirs)
    if family(ours.config.model_type).state_from_hf is not None:
        theirs_grads = family(ours.config.model_type).state_from_hf(theirs_grads, ours.config)
    assert_same_gradients(gradients(ours), theirs_grads, RTOL)

    # Without the scaling, the same weights would fail the comparison above.
    plain = type(ours)(ours.config.replace(rope_scaling=None))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert rel_err(plain(input_ids).logits, ref.logits) > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_pretrained_keeps_the_rope_parameters_and_the_logits(case, tmp_path):
    theirs = hf_model(case, seed=7)
    _, _, written = save_round_trip(theirs, tmp_path, RTOL)
    assert written["rope_parameters"] == {k: v for k, v in theirs.config.rope_parameters.items() if k != "type"}


def test_deepseek_softmax_scale_uses_mscale_all_dim(tmp_path):
    """mscale(factor, mscale_all_dim)² on head_dim^-0.5, as DeepseekV3Attention sets its scaling."""
    theirs = hf_model("deepseek_v3")
    theirs.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path)
    mscale = 0.1 * 0.7 * math.log(4.0) + 1.0
    assert ours.model.layers[0].self_attn.scale == pytest.approx((8 + 8) ** -0.5 * mscale**2, rel=1e-15)
    assert ours.model.layers[0].self_attn.scale == theirs.model.layers[0].self_attn.scaling


@pytest.mark.parametrize(
    "rope, message",
    [
        ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported"),
        ({"type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
        ({**YARN, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({**YARN, "factor": 0.5}, "factor must be a number >= 1"),
        ({"rope_type": "proportional", "original_max_position_embeddings": 4}, "original_max_position_embeddings"),
        ({"rope_type": "proportional", "partial_rotary_factor": 1.5}, r"partial_rotary_factor must be in \[0, 1\]"),
    ],
)
def test_unsupported_rope_parameters_raise_a_config_error(rope, message):
    hf = family("qwen3_moe").config_to_hf(ModelConfig())
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict({**hf, "rope_parameters": {**rope, "rope_theta": 1e4}})


def test_run_config_table_becomes_rope_scaling():
    """A run config (TOML) writes rope_parameters as a table, like config.json."""
    config = ModelConfig.from_hf_dict(
        {
            "model_type": "gpt_oss",
            "max_position_embeddings": 64,
            "rope_theta": 500.0,
            "rope_parameters": {"rope_type": "yarn", "factor": 8.0},
        }
    )
    assert config.rope_theta == 500.0
    assert config.rope_scaling == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}
    assert ModelConfig.from_hf_dict({"model_type": "qwen3_moe"}).rope_scaling is None
