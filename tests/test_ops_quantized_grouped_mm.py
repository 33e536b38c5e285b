"""The fused FP8 grouped GEMM (ops/quantized_grouped_mm.py) against the dequantize-then-multiply
it replaces, under Triton's interpreter on CPU (compiled on a GPU): partial tiles in both
dimensions (200 columns, 576 rows as DeepSeek-V3's kv_a_proj_with_mqa), a column offset (a TP
slice cutting a tile), empty experts, and rows past the last group (NaN here) that reach nothing.

Reference: float64 products of the weight `dequantize_reference` gives in the compute dtype. fp32:
1e-6 relative (accumulation order only); bf16: 5e-3 (the output's one rounding to bf16; the
weight rounded as dequantize rounds it, so no more)."""

import pytest
import torch

from moemesh.ops import quantized_grouped_mm as fused
from moemesh.ops.quantized_weight import QuantizedWeight, dequantize_reference
from numerics import rel_err


def fp8_bank(experts, rows, cols, offset=0):
    tiles = -(-(offset + cols) // 128)
    codes = (torch.randn(experts, rows, cols) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    return QuantizedWeight("fp8", codes, torch.rand(experts, rows, tiles) + 0.01, torch.float32, offset)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "rows, cols, offset, sizes, rest",
    [
        (200, 200, 0, [5, 0, 40, 3], 7),
        (576, 256, 0, [17, 1, 0, 9], 0),
        (96, 200, 78, [0, 33, 2, 16], 5),
        (64, 128, 0, [0, 0, 0, 0], 4),
    ],
)
def test_the_fused_product_is_the_dequantized_banks(dtype, rows, cols, offset, sizes, rest, triton_kernels):
    weight = fp8_bank(len(sizes), rows, cols, offset)
    weight.dtype = dtype
    group_sizes = torch.tensor(sizes)
    used = sum(sizes)
    x = torch.randn(used + rest, cols).to(dtype)
    x[used:] = float("nan")  # a buffer's unwritten rows: no group reads them
    if x.is_cuda and dtype == torch.float32:
        assert not fused.applies(x, weight)
        pytest.skip("a GPU's fp32 tl.dot rounds to TF32: fp32 products there dequantize instead")
    assert fused.applies(x, weight)
    out = fused.quantized_grouped_mm(x, weight, group_sizes)
    dense = dequantize_reference(weight, dtype).double()
    pieces = torch.split(x[:used].double(), sizes)
    reference = torch.cat([piece @ w.T for piece, w in zip(pieces, dense)]) if used else torch.zeros(0, rows)
    assert out.shape == (used + rest, rows) and out.dtype == dtype
    assert torch.isfinite(out[:used]).all()
    if used:
        error = rel_err(out[:used].double(), reference)
        assert error <= (1e-6 if dtype == torch.float32 else 5e-3), error


def test_it_applies_to_fp8_banks_where_triton_runs(monkeypatch):
    x = torch.randn(4, 128)
    bank = fp8_bank(2, 64, 128)
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    assert not fused.applies(x, bank)  # the reference everywhere: dequantize, then multiply
    monkeypatch.setenv("MOEMESH_KERNELS", "auto")
    assert fused.applies(x.cuda(), bank) if torch.cuda.is_available() else not fused.applies(x, bank)
    mxfp4 = QuantizedWeight(
        "mxfp4", torch.zeros(2, 64, 4, 16, dtype=torch.uint8), torch.zeros(2, 64, 4, dtype=torch.uint8)
    )
    assert not fused.applies(x, mxfp4)  # measured slower than dequantizing: not taken
    assert not fused.applies(x, torch.randn(2, 64, 128))
