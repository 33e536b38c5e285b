"""Model construction and the MoE block's edge cases (decoding: test_models_decoding.py)."""

import pytest
import torch

from moemesh.models import ModelConfig, build
from moemesh.models.moe import MoEBlock

CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    intermediate_size=24,
    mlp_only_layers=[1],
    initializer_range=0.1,
)


def test_build_is_deterministic_per_seed():
    a, b, c = build(CONFIG, seed=3), build(CONFIG, seed=3), build(CONFIG, seed=4)
    for (name, p), q, r in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(p, q), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(p, r), name


def test_a_parameter_does_not_depend_on_what_else_the_model_holds():
    """What lets a pipeline stage build only its own layers and still match one process."""
    small = build(CONFIG.replace(num_hidden_layers=1, mlp_only_layers=[]), seed=5).state_dict()
    large = build(CONFIG, seed=5).state_dict()
    for name, tensor in small.items():
        assert torch.equal(tensor, large[name]), name


def test_tied_embeddings_share_one_tensor():
    model = build(CONFIG.replace(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.num_params() == build(CONFIG).num_params() - CONFIG.vocab_size * CONFIG.hidden_size


def test_active_params_count_only_top_k_experts():
    model = build(CONFIG)
    expert = 2 * (CONFIG.num_experts * 3 * CONFIG.hidden_size * CONFIG.moe_intermediate_size)  # 2 MoE layers
    assert model.num_params() - model.num_params(active=True) == expert * 4 // 6  # 4 of 6 experts idle


@pytest.mark.parametrize("tokens", [0, 1, 5])
def test_moe_block_handles_zero_tokens_and_empty_experts(tokens):
    torch.manual_seed(0)
    block = build(CONFIG).model.layers[0].mlp
    assert isinstance(block, MoEBlock)
    x = torch.randn(tokens, CONFIG.hidden_size, requires_grad=True)
    out, stats = block(x)
    assert out.shape == (tokens, CONFIG.hidden_size)
    assert stats.counts.sum() == tokens * CONFIG.num_experts_per_tok
    out.sum().backward()
    assert x.grad.shape == x.shape
    # reference: every token through its own experts, one at a time
    routing = block.route(x.detach())
    for t in range(tokens):
        expected = torch.zeros(CONFIG.hidden_size)
        for w, e in zip(routing.weights[t], routing.expert_ids[t]):
            gate, up = (block.experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected += w * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-6)
