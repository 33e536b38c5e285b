"""expert_gemv: the per-expert Triton kernel (interpreted on CPU) against the gather + batched-
matmul reference in fp64, the two per-token kernels against that reference, SwiGLU and combine, and
the MoE block's selected-experts path (both forms) against its staged (grouped GEMM) path.

Tolerances: fp32 both sides, the same products summed in another order (the kernels in blocks of
K): relative error <= 1e-6 for an op, <= 1e-5 for a whole block (two GEMVs, an activation and
the weighted sum). A wrong expert, a row given another's output, a missing bias or a weight
applied twice is off by O(1). bf16: the roundings of gate, up and the output, <= 1e-2; on a GPU
only, as in test_ops_decode_kernels.py."""

import dataclasses

import pytest
import torch

from moemesh.models import build, moe
from moemesh.ops.combine import combine_pairs, combine_reference
from moemesh.ops.expert_gemv import expert_gemv, expert_gemv_combine, expert_gemv_reference, expert_swiglu_gemv
from moemesh.ops.swiglu import swiglu_reference
from numerics import rel_err
from test_models_decoding import FAMILIES
from test_ops_decode_kernels import DTYPES, tol


@pytest.mark.parametrize(
    "tokens, k, experts, out_features, inner",
    [
        (1, 2, 5, 7, 300),
        (13, 3, 4, 33, 17),
        (0, 2, 4, 8, 8),
        (6, 1, 1, 1, 513),
        (40, 4, 5, 20, 70),  # some expert chosen by 30+ pairs: more than one block of 16 rows
        (70, 8, 64, 16, 32),
    ],
)  # 560 pairs: the scan for an expert's pairs runs over three chunks
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(triton_kernels, tokens, k, experts, out_features, inner, dtype):
    x, weight = torch.randn(tokens, inner).to(dtype), torch.randn(experts, 2 * out_features, inner).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)]) if tokens else torch.zeros(0, k).long()
    expected = expert_gemv_reference(x.double(), weight.double(), ids)
    for t in range(tokens):  # the reference is what it says
        for j in range(k):
            torch.testing.assert_close(expected[t * k + j], weight[ids[t, j]].double() @ x[t].double())
    got = expert_gemv(x, weight, ids)
    assert got.shape == (tokens * k, 2 * out_features) and got.dtype == dtype
    assert tokens == 0 or rel_err(got, expected) <= tol(dtype)
    glu = expert_gemv(x, weight, ids, glu=True)  # silu(gate)·up, from the same weights
    assert glu.shape == (tokens * k, out_features)
    assert tokens == 0 or rel_err(glu, swiglu_reference(expected.to(dtype))) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [4, 3])
def test_per_token_expert_gemvs(triton_kernels, dtype, k):
    """silu(gate)·up straight from each token's experts, and the down projection summed with the
    routing weights, against the gather + bmm reference, SwiGLU and combine in fp64 (k = 3: the
    kernel pads the experts to 4)."""
    tokens, experts, inner, hidden = 3, 6, 300, 70  # inner: more than a block of K at every config
    x = torch.randn(tokens, hidden).to(dtype)
    gate_up, down = torch.randn(experts, 2 * inner, hidden).to(dtype), torch.randn(experts, hidden, inner).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    gated = expert_swiglu_gemv(x, gate_up, ids)
    assert rel_err(gated, swiglu_reference(expert_gemv_reference(x.double(), gate_up.double(), ids))) <= tol(dtype)
    positions = torch.arange(tokens * k).view(tokens, k)  # the reference from the kernel's own `gated`
    expected = combine_reference(
        expert_gemv_reference(gated.double(), down.double(), ids.view(-1, 1)), positions, weights.double()
    )
    got = expert_gemv_combine(gated, down, ids, weights)
    assert rel_err(got, expected) <= tol(dtype)
    assert torch.equal(expert_gemv_combine(gated, down, ids, weights, early_ids=True), got)  # first weights early


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_expert_gemvs_of_gpt_oss_experts(triton_kernels, dtype):
    """GPT-OSS's experts in the same two kernels: gate and up biases (each sum rounded, then the
    bias added and rounded, as the unfused path), its clamped SwiGLU (a limit that clamps about
    a third of gate and up), and the down bias weighted by the routing weights, at a share (a
    tensor-parallel rank's 1/2); against the gather + bmm reference, clamped_swiglu and combine."""
    from moemesh.ops.swiglu import clamped_swiglu

    tokens, k, experts, inner, hidden, alpha, limit, share = 3, 4, 6, 300, 70, 1.702, 10.0, 0.5
    x = torch.randn(tokens, hidden).to(dtype)
    gate_up, down = torch.randn(experts, 2 * inner, hidden).to(dtype), torch.randn(experts, hidden, inner).to(dtype)
    gate_up_bias, down_bias = torch.randn(experts, 2 * inner).to(dtype), torch.randn(experts, hidden).to(dtype)
    ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k)
    gated = expert_swiglu_gemv(x, gate_up, ids, bias=gate_up_bias, clamp=(alpha, limit))
    products = expert_gemv_reference(x.double(), gate_up.double(), ids)
    assert 0.2 < (products.abs() > limit).double().mean() < 0.5  # the clamp bites
    biased = products.to(dtype).double() + gate_up_bias[ids.flatten()].double()
    assert rel_err(gated, clamped_swiglu(biased, alpha, limit)) <= tol(dtype)
    assert rel_err(expert_swiglu_gemv(x, gate_up, ids), clamped_swiglu(biased, alpha, limit)) > 0.1  # (it matters)
    expected = combine_reference(
        expert_gemv_reference(gated.double(), down.double(), ids.view(-1, 1)),
        torch.arange(tokens * k).view(tokens, k),
        weights.double(),
    ) + (weights.double()[..., None] * down_bias[ids].double() * share).sum(1)
    got = expert_gemv_combine(gated, down, ids, weights, early_ids=True, bias=down_bias, bias_share=share)
    assert rel_err(got, expected) <= tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_token", [False, True])
def test_a_bank_of_some_experts_adds_only_its_own(triton_kernels, dtype, per_token):
    """A rank holding experts 2..4 of 7 (`first_expert=2`) is given the step's global ids: the rows
    of its pairs are the whole bank's, and the block's output is the whole bank's with the other
    experts' slots weighing nothing (token 0 chose none of them: a zero row). Per token (the
    fused kernels) and per expert (`combine_pairs`)."""
    tokens, k, experts, first, here, inner, hidden = (3 if per_token else 13), 3, 7, 2, 3, 24, 40
    x = torch.randn(tokens, hidden).to(dtype)
    gate_up, down = torch.randn(experts, 2 * inner, hidden).to(dtype), torch.randn(experts, hidden, inner).to(dtype)
    ids = torch.stack([torch.tensor([0, 5, 6])] + [torch.randperm(experts)[:k] for _ in range(tokens - 1)])
    weights = torch.rand(tokens, k)
    bank = slice(first, first + here)
    if per_token:
        gated = expert_swiglu_gemv(x, gate_up[bank], ids, first)
    else:
        gated = expert_gemv(x, gate_up[bank], ids, glu=True, first_expert=first)
    mine = ((ids >= first) & (ids < first + here)).flatten()
    whole = swiglu_reference(expert_gemv_reference(x.double(), gate_up.double(), ids))
    assert rel_err(gated[mine], whole[mine]) <= tol(dtype)
    gated = torch.where(mine[:, None], gated, 0)  # the other rows are left unwritten
    expected = combine_reference(
        expert_gemv_reference(gated.double(), down.double(), ids.view(-1, 1)),
        torch.arange(tokens * k).view(tokens, k),
        weights.double() * mine.view(tokens, k),
    )
    if per_token:
        out = expert_gemv_combine(gated, down[bank], ids, weights, first)
    else:
        out = combine_pairs(
            expert_gemv(gated, down[bank], ids.view(-1, 1), first_expert=first), ids, weights, first, here
        )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and rel_err(out, expected) <= tol(dtype)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("hidden_act", ["silu", "gelu_pytorch_tanh"])
def test_a_rank_s_experts_module_adds_only_its_own(request, kernels, hidden_act):
    """`Experts.selected` of a rank holding experts 2..4 of 7, given the step's global ids
    (`first_expert=2`), equals the whole bank's with the other experts' slots weighing nothing —
    SwiGLU (the fused path) and GeGLU (the activation apart: Gemma), on the reference and under
    Triton's interpreter (fp32: relative error 1e-5, the kernels' fp32 sums in other orders)."""
    from moemesh.models import ModelConfig
    from tiny_run import TINY_MODEL

    if kernels == "triton":
        request.getfixturevalue("triton_kernels")
    config = ModelConfig(**{**TINY_MODEL, "num_experts": 7, "num_experts_per_tok": 3, "hidden_act": hidden_act})
    whole = moe.Experts(config)
    for bank in (whole.gate_up_proj, whole.down_proj):
        torch.nn.init.normal_(bank, std=0.2)
    rank = moe.Experts(dataclasses.replace(config, num_experts=3))
    rank.gate_up_proj.data, rank.down_proj.data = whole.gate_up_proj.data[2:5], whole.down_proj.data[2:5]
    tokens = 5
    x = torch.randn(tokens, config.hidden_size)
    ids = torch.stack([torch.tensor([0, 5, 6])] + [torch.randperm(7)[:3] for _ in range(tokens - 1)])
    weights = torch.rand(tokens, 3)
    mine = (ids >= 2) & (ids < 5)
    with torch.no_grad():
        got = rank.selected(x, ids, weights, first_expert=2)
        expected = whole.selected(x, ids, weights * mine)
    assert torch.equal(got[0], torch.zeros_like(got[0])) and rel_err(got, expected) <= 1e-5


def test_combine_pairs_kernel_equals_its_reference(triton_kernels):
    """The slots of a bank's experts summed in slot order, the kernel (interpreted) against torch."""
    rows, ids, weights = torch.randn(12, 9), torch.randint(0, 6, (4, 3)), torch.rand(4, 3)
    got = combine_pairs(rows, ids, weights, 2, 3)
    expected = combine_reference(
        rows.double(), torch.where((ids >= 2) & (ids < 5), torch.arange(12).view(4, 3), -1), weights.double(), skip=True
    )
    assert rel_err(got, expected) <= 1e-6
    assert (
        rel_err(combine_pairs(rows, ids, weights), combine_reference(rows, torch.arange(12).view(4, 3), weights))
        <= 1e-6
    )


def test_bad_shapes_are_refused():
    with pytest.raises(
        ValueError, match=r"need x \[T, K\], weight \[E, O, K\] \(O even with glu\), expert_ids \[T, k\]"
    ):
        expert_gemv(torch.randn(3, 4), torch.randn(2, 5, 6), torch.zeros(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="O even with glu"):
        expert_gemv(torch.randn(3, 4), torch.randn(2, 5, 4), torch.zeros(3, 1, dtype=torch.long), glu=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "gemma4"])
@pytest.mark.parametrize(
    "kernels, per_token_rows", [("torch", moe.PER_TOKEN_ROWS), ("triton", moe.PER_TOKEN_ROWS), ("triton", 0)]
)  # the reference has no per-token form
def test_selected_experts_equal_the_staged_block(request, monkeypatch, family, kernels, per_token_rows):
    """Expert biases (GPT-OSS, with its clamped SwiGLU), shared experts and routed scaling
    (DeepSeek-V3), GeGLU and per-expert scales (Gemma 4); an odd number of tokens; SwiGLU experts
    per token and per expert. The Triton kernels run compiled on a GPU, interpreted on a CPU."""
    if kernels == "triton":
        request.getfixturevalue("triton_kernels")
    monkeypatch.setenv("MOEMESH_KERNELS", kernels)
    monkeypatch.setattr(moe, "PER_TOKEN_ROWS", per_token_rows)
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
        assert block.reads_selected_experts(moe.SELECTED_EXPERT_ROWS // block.gate.top_k)
        assert not block.reads_selected_experts(moe.SELECTED_EXPERT_ROWS // block.gate.top_k + 1)
