"""The decoding kernels on quantized weights (ops/gemv.py, ops/expert_gemv.py reading a
QuantizedWeight's codes and scales, decoded in registers by quantized_weight.load_rows) against
their references: the weight dequantized, then the dense reference (in fp64 here).

Under Triton's interpreter on a CPU (compiled on a GPU): block FP8 with partial tiles, a column
offset (a TP slice that cuts a tile) and 576 rows (DeepSeek-V3's kv_a_proj_with_mqa), MXFP4 with
its 32-groups; a bank's experts that no token chose, a bank of some of the experts
(`first_expert`), zero tokens; each tile of the kernels' autotuning lists (blocks of K shorter
than a 128-wide tile read one scale a row, longer ones broadcast each tile's). fp32: relative error
<= 1e-6, the same products summed in another order; a wrong scale, nibble or tile is off by O(1).
"""

import pytest
import torch

from moemesh.checkpoint.quantized import quantize_fp8, quantize_mxfp4
from moemesh.ops import expert_gemv as expert_gemv_module
from moemesh.ops import gemv
from moemesh.ops.backend import HAVE_TRITON, INTERPRETED, _FirstConfig
from moemesh.ops.combine import combine_pairs, combine_reference
from moemesh.ops.expert_gemv import (
    expert_gemv,
    expert_gemv_combine,
    expert_gemv_reference,
    expert_pair_gemv,
    expert_swiglu_gemv,
)
from moemesh.ops.quantized_weight import FP8_TILE, QuantizedWeight
from moemesh.ops.swiglu import clamped_swiglu, swiglu_reference
from numerics import rel_err

FORMATS = ["fp8", "fp8-offset", "mxfp4"]


def quantized(weight: torch.Tensor, fmt: str) -> QuantizedWeight:
    """`weight` [..., R, C] quantized by the published rules: fp8 on 128 x 128 tiles (fp8-offset:
    the columns of a block that starts 50 columns into its tile, the scales per row as
    QuantizedWeight keeps them), mxfp4 on 32-groups."""
    if fmt == "mxfp4":
        return QuantizedWeight("mxfp4", *quantize_mxfp4(weight), weight.dtype)
    offset = 50 if fmt == "fp8-offset" else 0
    codes, scales = quantize_fp8(torch.nn.functional.pad(weight, (offset, 0)))
    rows = weight.shape[-2]
    per_row = scales.repeat_interleave(FP8_TILE, -2)[..., :rows, :].contiguous()
    return QuantizedWeight("fp8", codes[..., offset:].contiguous(), per_row, weight.dtype, offset)


def wide(weight: QuantizedWeight) -> QuantizedWeight:
    """The same codes standing for fp64 (the references' dtype)."""
    return QuantizedWeight(weight.format, weight.codes, weight.scales, torch.float64, weight.offset)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_reads_quantized_weights(triton_kernels, fmt, rows):
    x = torch.randn(rows, 320)  # 320: a partial last tile (and ten 32-groups)
    weights = [quantized(torch.randn(n, 320), fmt) for n in (576, 5, 33)]
    with torch.no_grad():
        assert gemv.fits(x, *weights) and gemv.fits(x, weights[1])
        assert not gemv.fits(x, weights[0], torch.randn(5, 320))  # one launch: one kind of weight
        for out, expected in zip(gemv.gemv(x, weights), gemv.gemv_reference(x.double(), [wide(w) for w in weights])):
            assert out.shape == expected.shape and out.dtype == x.dtype
            assert rel_err(out, expected) <= 1e-6, fmt


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [0, 5])
def test_expert_gemvs_read_quantized_banks(triton_kernels, fmt, tokens):
    """Per expert (plain and fused SwiGLU) and per token (plain, SwiGLU, the down projection with
    the weighted sum), a bank of 6 experts of which 4 at most are chosen."""
    k, experts, inner, hidden = 2, 6, 64, 96
    x = torch.randn(tokens, hidden)
    gate_up = quantized(torch.randn(experts, 2 * inner, hidden), fmt)
    down = quantized(torch.randn(experts, hidden, inner), fmt)
    ids = torch.stack([torch.randperm(4)[:k] for _ in range(tokens)]) if tokens else torch.zeros(0, k).long()
    weights = torch.rand(tokens, k)
    with torch.no_grad():
        expected = expert_gemv_reference(x.double(), wide(gate_up), ids)
        got = expert_gemv(x, gate_up, ids)
        assert got.shape == (tokens * k, 2 * inner)
        assert tokens == 0 or rel_err(got, expected) <= 1e-6
        per_pair = expert_pair_gemv(x, gate_up, ids)  # the per-token form, for experts with biases
        assert per_pair.shape == got.shape and (tokens == 0 or rel_err(per_pair, expected) <= 1e-6)
        glu = expert_gemv(x, gate_up, ids, glu=True)
        assert tokens == 0 or rel_err(glu, swiglu_reference(expected)) <= 1e-6
        gated = expert_swiglu_gemv(x, gate_up, ids)
        assert gated.shape == (tokens * k, inner)
        assert tokens == 0 or rel_err(gated, swiglu_reference(expected)) <= 1e-6
        positions = torch.arange(tokens * k).view(tokens, k)
        summed = combine_reference(
            expert_gemv_reference(gated.double(), wide(down), ids.view(-1, 1)), positions, weights.double()
        )
        out = expert_gemv_combine(gated, down, ids, weights, early_ids=True)
        assert out.shape == (tokens, hidden)
        assert tokens == 0 or rel_err(out, summed) <= 1e-6
        by_expert = combine_pairs(expert_gemv(gated, down, ids.view(-1, 1)), ids, weights)
        assert tokens == 0 or rel_err(by_expert, summed) <= 1e-6
        # GPT-OSS's form: biases on gate, up and down, its clamped SwiGLU
        gate_up_bias, down_bias = torch.randn(experts, 2 * inner), torch.randn(experts, hidden)
        gated = expert_swiglu_gemv(x, gate_up, ids, bias=gate_up_bias, clamp=(1.702, 2.0))
        biased = expected + gate_up_bias[ids.flatten()].double()
        assert tokens == 0 or rel_err(gated, clamped_swiglu(biased, 1.702, 2.0)) <= 1e-6
        per_pair = expert_pair_gemv(x, gate_up, ids, bias=gate_up_bias)  # (the form of other activations)
        assert tokens == 0 or rel_err(per_pair, biased) <= 1e-6
        out = expert_gemv_combine(gated, down, ids, weights, bias=down_bias)
        summed = combine_reference(
            expert_gemv_reference(gated.double(), wide(down), ids.view(-1, 1)), positions, weights.double()
        ) + (weights.double()[..., None] * down_bias[ids].double()).sum(1)
        assert tokens == 0 or rel_err(out, summed) <= 1e-6


@pytest.mark.parametrize("fmt", ["fp8-offset", "mxfp4"])
def test_a_quantized_bank_of_some_experts_adds_only_its_own(triton_kernels, fmt):
    """Experts 2..4 of 7 on this rank (`first_expert=2`), quantized: the other ranks' slots add
    nothing, token 0 chose none of them (a zero row)."""
    tokens, k, first, inner, hidden = 3, 3, 2, 32, 64
    x = torch.randn(tokens, hidden)
    gate_up_whole, down_whole = torch.randn(7, 2 * inner, hidden), torch.randn(7, hidden, inner)
    gate_up, down = quantized(gate_up_whole[2:5], fmt), quantized(down_whole[2:5], fmt)
    ids = torch.stack([torch.tensor([0, 5, 6])] + [torch.randperm(7)[:k] for _ in range(tokens - 1)])
    weights = torch.rand(tokens, k)
    mine = (ids >= first) & (ids < first + 3)
    with torch.no_grad():
        gated = expert_swiglu_gemv(x, gate_up, ids, first)
        expected = swiglu_reference(expert_gemv_reference(x.double(), wide(gate_up), ids, first))
        assert rel_err(gated[mine.flatten()], expected[mine.flatten()]) <= 1e-6
        gated = torch.where(mine.flatten()[:, None], gated, 0)
        out = expert_gemv_combine(gated, down, ids, weights, first)
        summed = combine_reference(
            expert_gemv_reference(gated.double(), wide(down), ids.view(-1, 1), first),
            torch.arange(tokens * k).view(tokens, k),
            weights.double() * mine,
        )
    assert torch.equal(out[0], torch.zeros_like(out[0])) and rel_err(out, summed) <= 1e-6


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_every_tile_the_autotuner_may_pick_reads_the_codes_right(triton_kernels, monkeypatch, fmt):
    """Each config of the four kernels' lists as the tile: blocks of K of 32 to 1024 against the
    128-wide FP8 tiles and the 32-groups."""
    if not (HAVE_TRITON and INTERPRETED):
        pytest.skip("on a GPU the autotuner runs every config at a shape's first launch (the tests above)")
    x = torch.randn(2, 160)
    weight = quantized(torch.randn(20, 160), fmt)
    bank, down = quantized(torch.randn(3, 64, 160), fmt), quantized(torch.randn(3, 160, 32), fmt)
    ids = torch.tensor([[0, 2], [2, 1]])
    with torch.no_grad():
        linear = gemv.gemv_reference(x.double(), [wide(weight)])[0]
        plain = expert_gemv_reference(x.double(), wide(bank), ids)
        gated = swiglu_reference(plain).float()
        summed = combine_reference(
            expert_gemv_reference(gated.double(), wide(down), ids.view(-1, 1)), torch.arange(4).view(2, 2), ids.double()
        )
        kernels = [
            (gemv, "_gemv_kernel", gemv.ROW_CONFIGS, lambda: gemv.gemv(x[:1], [weight])[0], linear[:1]),
            (gemv, "_gemv_kernel", gemv.CONFIGS[:7], lambda: gemv.gemv(x, [weight])[0], linear),
            (expert_gemv_module, "_by_expert_kernel", expert_gemv_module.BY_EXPERT_CONFIGS,
             lambda: expert_gemv(x, bank, ids, glu=True), gated),
            (expert_gemv_module, "_per_pair_kernel", expert_gemv_module.ROW_CONFIGS,
             lambda: expert_swiglu_gemv(x, bank, ids), gated),
            (expert_gemv_module, "_per_pair_kernel", expert_gemv_module.ROW_CONFIGS,
             lambda: expert_pair_gemv(x, bank, ids), plain),
            (expert_gemv_module, "_expert_gemv_combine_kernel", expert_gemv_module.ROW_CONFIGS,
             lambda: expert_gemv_combine(gated, down, ids, ids.float()), summed),
        ]  # fmt: skip
        for module, name, configs, run, expected in kernels:
            kernel = getattr(module, name).kernel
            for config in configs:
                monkeypatch.setattr(module, name, _FirstConfig(kernel, config))
                assert rel_err(run(), expected) <= 1e-6, (name, config.kwargs)
            monkeypatch.undo()
            monkeypatch.setenv("MOEMESH_KERNELS", "triton")


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_experts_on_quantized_banks_equal_the_dequantized_banks(request, kernels, fmt):
    """`Experts.selected` (both kernel forms: a few tokens per token, more per expert) on
    quantized banks, against the same module with the banks dequantized to fp32: exactly on the
    reference (it dequantizes the chosen experts), to fp32 rounding with the kernels."""
    from moemesh.models import ModelConfig, moe
    from tiny_run import TINY_MODEL

    if kernels == "triton":
        request.getfixturevalue("triton_kernels")
    config = ModelConfig(**{**TINY_MODEL, "num_experts": 5, "num_experts_per_tok": 2, "hidden_size": 64})
    dense = moe.Experts(config)
    kept = moe.Experts(config)
    for name in ("gate_up_proj", "down_proj"):
        weight = quantized(torch.randn(getattr(dense, name).shape) * 0.2, fmt)
        getattr(dense, name).data = weight.to(torch.float32)
        del kept._parameters[name]
        setattr(kept, name, weight)
    for tokens in (3, 40):  # 6 pairs: per token; 80 pairs: per expert
        x = torch.randn(tokens, 64)
        ids = torch.stack([torch.randperm(5)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2)
        with torch.no_grad():
            got, expected = kept.selected(x, ids, weights), dense.selected(x, ids, weights)
        assert torch.equal(got, expected) if kernels == "torch" else rel_err(got, expected) <= 1e-5
