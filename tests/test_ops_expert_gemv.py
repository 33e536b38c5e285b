"""expert_gemv: the Triton kernel (interpreted on CPU) against the gather + batched-matmul
reference, and the MoE block's selected-experts path against its staged (grouped GEMM) path.

Tolerances: fp32 both sides, the same products summed in another order (the kernel in blocks of
K): relative error <= 1e-6 for the op, <= 1e-5 for a whole block (two GEMVs, an activation and
the weighted sum). A wrong expert, a missing bias or a weight applied twice is off by O(1)."""

import pytest
import torch

from moemesh.models import build
from moemesh.ops.expert_gemv import expert_gemv, expert_gemv_reference
from numerics import rel_err
from test_models_decoding import FAMILIES


@pytest.mark.parametrize("rows, experts, out_features, inner", [(1, 5, 7, 300), (13, 3, 33, 17), (0, 4, 8, 8),
                                                                (6, 1, 1, 513)])
def test_triton_matches_reference(triton_kernels, rows, experts, out_features, inner):
    x, weight = torch.randn(rows, inner), torch.randn(experts, out_features, inner)
    ids = torch.randint(0, experts, (rows,))
    got = expert_gemv(x, weight, ids)
    assert got.shape == (rows, out_features)
    assert rel_err(got, expert_gemv_reference(x, weight, ids)) <= 1e-6 or rows == 0
    for i in range(rows):  # the reference is what it says
        torch.testing.assert_close(expert_gemv_reference(x, weight, ids)[i], weight[ids[i]] @ x[i])


def test_triton_bf16_vs_fp32_reference(triton_kernels):
    """bf16 weights and inputs, fp32 accumulation: one bf16 rounding of the output, <= 1e-2."""
    x, weight = torch.randn(5, 130), torch.randn(4, 20, 130)
    ids = torch.tensor([3, 0, 3, 1, 2])
    got = expert_gemv(x.bfloat16(), weight.bfloat16(), ids)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, expert_gemv_reference(x, weight, ids)) <= 1e-2


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"need x \[N, K\], weight \[E, O, K\], expert_ids \[N\]"):
        expert_gemv(torch.randn(3, 4), torch.randn(2, 5, 6), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_selected_experts_equal_the_staged_block(request, monkeypatch, family, kernels):
    """Expert biases (GPT-OSS, with its clamped SwiGLU), shared experts and routed scaling
    (DeepSeek-V3), GeGLU and per-expert scales (Gemma 4); an odd number of tokens. The Triton
    kernel runs compiled on a GPU, interpreted on a CPU."""
    if kernels == "triton":
        request.getfixturevalue("triton_kernels")
    monkeypatch.setenv("MOEMESH_KERNELS", kernels)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    model = build(FAMILIES[family], seed=2, device=device)
    layer = model.model.layers[-1]
    h = torch.randn(1, 7, model.config.hidden_size, device=device)
    with torch.no_grad():
        x, routing = layer.route(h)
        assert layer.mlp.reads_selected_experts(x.shape[0])
        selected = layer.mlp.selected_experts(x, routing)
        dispatched = layer.dispatch(x, routing)
        staged = layer.combine(layer.experts(dispatched), dispatched, routing, x.shape[0])
    assert rel_err(selected, staged) <= 1e-5


def test_the_block_keeps_the_staged_path_for_gradients_and_many_tokens():
    block = build(FAMILIES["qwen3_moe"], seed=0).model.layers[0].mlp
    assert not block.reads_selected_experts(1)  # gradients on
    with torch.no_grad():
        assert block.reads_selected_experts(64 // block.gate.top_k)
        assert not block.reads_selected_experts(64 // block.gate.top_k + 1)
