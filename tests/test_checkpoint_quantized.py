"""The published quantized formats, read and written (checkpoint/quantized.py, quantized_layout.py).

- Dequantization is the published formula, written here from its definition (not from the code
  under test): block FP8 w = fp8 x scale over each 128 x 128 tile, the edge tiles partial
  (DeepSeek-V3's kv_a_proj_with_mqa, 576 x 7168 on a 5 x 56 grid), scales F32, BF16, F16, powers
  of two (ue8m0) also as one byte; MXFP4 element 2j in the low nibble of byte j of its 32-group,
  E2M1 times 2^(scale - 127). Exact, bit for bit, read whole or in any block (TP rows, columns
  cutting a tile or a 32-group in the middle), and equal to transformers' own dequantization
  where that is right (MXFP4 everywhere, FP8 at multiples of 128).
- A block reads only its rows of the fp8 elements (its 32-groups of the MXFP4 bytes) and the
  scales of the tiles covering it.
- Quantization follows the rules stated in quantized.py (amax / 448 per tile; OCP's
  2^(floor(log2 amax) - 2) per group, nearest E2M1, ties to even), checked against references
  written here; weights that came quantized and are dequantized in fp32 quantize back to the
  same bytes, including the tiles where amax / 448 of the dequantized values misses the scale by
  one ulp.
- Any other quantization method is one line (CheckpointError, exit code 2), before anything is
  read, and `moemesh convert` creates nothing.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from moemesh.checkpoint import lazy
from moemesh.checkpoint import quantized as formats
from moemesh.checkpoint.lazy import SafetensorsFiles
from moemesh.checkpoint.load import read_model_config
from moemesh.checkpoint.quantized import (
    dequantize_fp8,
    dequantize_mxfp4,
    quantize_fp8,
    quantize_mxfp4,
    scheme_of,
)
from moemesh.checkpoint.quantized_layout import dequantized
from moemesh.cli import main
from moemesh.errors import CheckpointError
from published_quantization import COMPRESSED_TENSORS, FP8, GPT_OSS_MXFP4

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # codes 0-7; 8-15 their negatives


# ---- the published formulas, from their definitions -------------------------------------------
def reference_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """w = fp8 x scale over each block x block tile, tile by tile, in fp32."""
    out = torch.empty(weight.shape, dtype=torch.float32)
    for i in range(0, weight.shape[-2], block):
        for j in range(0, weight.shape[-1], block):
            tile = weight[..., i : i + block, j : j + block].float()
            out[..., i : i + block, j : j + block] = tile * scale[..., i // block, j // block, None, None].float()
    return out


def reference_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., out, G, 16] bytes, [..., out, G] E8M0 -> [..., out, 32 G]: element j of a row is byte
    (j mod 32) // 2 of group j // 32, the low nibble for even j; code c is +-E2M1_VALUES[c mod 8]
    (negative from 8); times 2^(scale - 127). Computed in float64, exact, then stored in fp32."""
    bytes_ = blocks.long()
    codes = torch.stack([bytes_ % 16, bytes_ // 16], dim=-1).flatten(-2)  # [..., G, 32]: 2j low, 2j+1 high
    magnitude = torch.tensor(E2M1_VALUES, dtype=torch.float64)[codes % 8]
    value = torch.where(codes >= 8, -magnitude, magnitude) * torch.pow(2.0, scales.double() - 127).unsqueeze(-1)
    return value.flatten(-2).float()


def reference_quantize_fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's and llm-compressor's rule: per tile scale = amax / 448 (1 for a zero tile), fp8 =
    w / scale clamped to +-448, rounded to nearest even (torch's cast)."""
    w = weight.float()
    rows, cols = w.shape
    scale = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    quantized = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            tile = w[i : i + block, j : j + block]
            amax = tile.abs().max()
            s = amax / 448 if amax > 0 else torch.tensor(1.0)
            scale[i // block, j // block] = s
            quantized[i : i + block, j : j + block] = (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return quantized, scale


def reference_quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The OCP MX v1.0 rule: per 32-group X = 2^(floor(log2 amax) - 2) (byte 0 for a zero group),
    each element the E2M1 value nearest to w / X (of two equally near, the even code), its sign
    kept; packed two a byte, element 2j low."""
    w = weight.double().unflatten(-1, (-1, 32))
    amax = w.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
    x = w / torch.pow(2.0, exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    distance = (x.abs().unsqueeze(-1) - grid).abs()
    nearest = distance == distance.min(-1, keepdim=True).values
    even_first = torch.where(nearest, torch.arange(8) % 2, torch.full_like(nearest, 2, dtype=torch.long))
    code = even_first.argmin(-1) + 8 * torch.signbit(x).long()
    blocks = (code[..., 0::2] + 16 * code[..., 1::2]).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def random_fp8(*shape: int) -> torch.Tensor:
    """Every finite e4m3 code, both signs (0x7F and 0xFF are NaN)."""
    codes = torch.randint(0, 255, shape, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x7E
    return codes.view(torch.float8_e4m3fn)


def lazy_tensors(tmp_path, tensors: dict, config: dict, name: str = "t") -> dict:
    """`tensors` written to a safetensors file, read back lazily and dequantized as `config` says."""
    file = tmp_path / f"{name}.safetensors"
    save_file(tensors, str(file))
    return dequantized(SafetensorsFiles([file]).tensors, scheme_of({"quantization_config": config}, tmp_path), file)


def read(tensor, index=None) -> torch.Tensor:
    shape = tensor.shape if index is None else [len(i) for i in index]
    out = torch.empty(shape, dtype=torch.float32)
    tensor.read_into(out, index)
    return out


# ---- block FP8 ---------------------------------------------------------------------------------
SCALES = {
    "f32": lambda shape: torch.rand(shape) * 1e-2 + 1e-4,
    "bf16": lambda shape: (torch.rand(shape) * 1e-2 + 1e-4).bfloat16(),
    "f16": lambda shape: (torch.rand(shape) * 1e-2 + 1e-4).half(),
    "ue8m0": lambda shape: torch.pow(2.0, torch.randint(-20, 0, shape).float()),  # V3.1: powers of two in F32
}
if hasattr(torch, "float8_e8m0fnu"):
    SCALES["ue8m0_byte"] = lambda shape: torch.pow(2.0, torch.randint(-20, 0, shape).float()).to(torch.float8_e8m0fnu)


@pytest.mark.parametrize("scales", sorted(SCALES))
def test_fp8_is_the_published_formula_on_every_tile_and_every_block(tmp_path, monkeypatch, scales):
    monkeypatch.setattr(formats, "_ROWS", 100)  # read in pieces of 100 rows, cutting tiles
    # DeepSeek-V3's kv_a_proj_with_mqa (576 x 7168: a 5 x 56 grid, its last row of tiles 64 rows), and
    # a weight partial both ways
    shapes = {"kv_a_proj_with_mqa": (576, 7168), "odd": (160, 300)}
    stored, expected = {}, {}
    for name, (rows, cols) in shapes.items():
        weight, scale = random_fp8(rows, cols), SCALES[scales]((math.ceil(rows / 128), math.ceil(cols / 128)))
        stored |= {f"{name}.weight": weight, f"{name}.weight_scale_inv": scale}
        expected[name] = reference_fp8(weight, scale)
        assert torch.equal(dequantize_fp8(weight, scale), expected[name])
    config = {**FP8, "scale_fmt": "ue8m0"} if scales.startswith("ue8m0") else FP8
    tensors = lazy_tensors(tmp_path, stored, config)
    assert sorted(tensors) == ["kv_a_proj_with_mqa.weight", "odd.weight"]  # the scales went into the weights
    for name, reference in expected.items():
        assert torch.equal(read(tensors[f"{name}.weight"]), reference), name
    # blocks a rank reads: TP rows cutting tiles (100:388), two runs of columns (gate | up halves), rows
    # at the partial edge
    lazy_kv = tensors["kv_a_proj_with_mqa.weight"]
    for rows, cols in [
        (torch.arange(100, 388), torch.arange(7168)),
        (torch.arange(576), torch.cat([torch.arange(60, 200), torch.arange(3000, 3100)])),
        (torch.arange(500, 576), torch.arange(7100, 7168)),
    ]:
        assert torch.equal(read(lazy_kv, (rows, cols)), expected["kv_a_proj_with_mqa"][rows][:, cols])


def test_fp8_equals_transformers_at_multiples_of_128():
    """transformers' Fp8Dequantize infers the tile from the shapes (rows / scale rows), which is the
    published tile only where 128 divides the weight: there the two agree bit for bit."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    for scale_dtype in (torch.float32, torch.bfloat16):
        weight, scale = random_fp8(256, 384), (torch.rand(2, 3) * 1e-2).to(scale_dtype)
        theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, torch.float32)
        assert torch.equal(dequantize_fp8(weight, scale), theirs)
        assert torch.equal(reference_fp8(weight, scale), theirs)


def test_fp8_reads_only_the_rows_and_tile_scales_of_its_block(tmp_path, monkeypatch):
    weight, scale = random_fp8(576, 7168), torch.rand(5, 56)
    tensor = lazy_tensors(tmp_path, {"w.weight": weight, "w.weight_scale_inv": scale}, FP8)["w.weight"]
    boxes = []
    box = lazy.Stored._box
    monkeypatch.setattr(lazy.Stored, "_box", lambda self, b: boxes.append((self.key, b)) or box(self, b))
    read(tensor, (torch.arange(200, 300), torch.arange(1000, 1100)))  # a block inside tile rows 1-2, columns 7-8
    assert boxes == [("w.weight", [(200, 300), (1000, 1100)]), ("w.weight_scale_inv", [(1, 3), (7, 9)])]


def test_fp8_of_a_module_left_unconverted_is_read_as_stored(tmp_path):
    bf16 = torch.randn(8, 8).bfloat16()
    tensors = lazy_tensors(
        tmp_path,
        {"a.weight": random_fp8(8, 8), "a.weight_scale_inv": torch.rand(1, 1), "lm_head.weight": bf16},
        {**FP8, "modules_to_not_convert": ["lm_head"]},
    )
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and torch.equal(
        read(tensors["lm_head.weight"]), bf16.float()
    )
    with pytest.raises(CheckpointError, match=r"a\.weight is stored in float8 without its weight_scale_inv"):
        lazy_tensors(tmp_path, {"a.weight": random_fp8(8, 8)}, FP8, "lone")


def test_compressed_tensors_block_fp8_is_the_same_arithmetic(tmp_path):
    weight, scale = random_fp8(300, 160), torch.rand(3, 2).bfloat16()
    router = torch.randn(4, 160).bfloat16()
    tensors = lazy_tensors(
        tmp_path,
        {"l.mlp.down_proj.weight": weight, "l.mlp.down_proj.weight_scale": scale, "l.mlp.gate.weight": router},
        COMPRESSED_TENSORS,
    )
    assert torch.equal(read(tensors["l.mlp.down_proj.weight"]), reference_fp8(weight, scale))
    assert torch.equal(read(tensors["l.mlp.gate.weight"]), router.float())


def test_fp8_with_a_scale_of_the_wrong_grid_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match=r"scale of shape \(4, 56\).*need \(5, 56\)"):
        lazy_tensors(tmp_path, {"w.weight": random_fp8(576, 7168), "w.weight_scale_inv": torch.rand(4, 56)}, FP8)


# ---- MXFP4 -------------------------------------------------------------------------------------
def test_mxfp4_is_the_published_formula_and_transformers_bit_for_bit(tmp_path, monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    monkeypatch.setattr(formats, "_ROWS", 3)  # read in pieces of 3 rows

    experts, rows, groups = 3, 10, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8)
    scales = torch.randint(100, 140, (experts, rows, groups), dtype=torch.uint8)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # 2^-127 (subnormal), 2^-126, 2^127
    expected = reference_mxfp4(blocks, scales)
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out], transformers' layout
    assert torch.equal(theirs, expected.transpose(1, 2))

    stored = {"l.mlp.experts.gate_up_proj_blocks": blocks, "l.mlp.experts.gate_up_proj_scales": scales}
    tensor = lazy_tensors(tmp_path, stored, GPT_OSS_MXFP4)["l.mlp.experts.gate_up_proj"]  # transformers' [E, in, out]
    assert tensor.shape == (experts, groups * 32, rows)
    assert torch.equal(read(tensor), theirs)
    # an expert, columns cutting 32-groups in the middle (16:80), interleaved rows (gpt-oss' gate rows)
    index = (torch.tensor([1]), torch.arange(16, 80), torch.arange(0, rows, 2))
    assert torch.equal(read(tensor, index), theirs[1:2, 16:80, 0::2])


def test_mxfp4_reads_only_the_groups_of_its_columns(tmp_path, monkeypatch):
    blocks = torch.randint(0, 256, (4, 8, 6, 16), dtype=torch.uint8)
    scales = torch.randint(110, 130, (4, 8, 6), dtype=torch.uint8)
    stored = {"e.down_proj_blocks": blocks, "e.down_proj_scales": scales}
    tensor = lazy_tensors(tmp_path, stored, GPT_OSS_MXFP4)["e.down_proj"].transpose(-2, -1)  # [E, out, in]
    boxes = []
    box = lazy.Stored._box
    monkeypatch.setattr(lazy.Stored, "_box", lambda self, b: boxes.append((self.key, b)) or box(self, b))
    index = (torch.tensor([2, 3]), torch.arange(8), torch.arange(48, 96))  # experts 2-3, columns 48:96: groups 1-2
    assert torch.equal(read(tensor, index), reference_mxfp4(blocks, scales)[2:4, :, 48:96])
    assert {key for key, _ in boxes} == {"e.down_proj_blocks", "e.down_proj_scales"}
    for key, b in boxes:  # one expert at a time, its rows, groups 1-2
        assert b[0][1] - b[0][0] == 1 and b[1:3] == [(0, 8), (1, 3)], (key, b)


# ---- quantization and the round trip -----------------------------------------------------------
def test_fp8_quantization_is_amax_over_448_and_its_output_comes_back_bit_for_bit(monkeypatch):
    monkeypatch.setattr(formats, "_ROWS", 256)  # quantized in bands of 2 tile rows
    weight = torch.randn(300, 200).bfloat16()  # partial tiles both ways
    weight[128:256, 128:] = 0  # a zero tile: scale 1
    quantized, scale = quantize_fp8(weight)
    ref_quantized, ref_scale = reference_quantize_fp8(weight)
    assert scale.dtype == torch.float32 and scale.shape == (3, 2) and scale[1, 1] == 1
    assert torch.equal(scale, ref_scale) and torch.equal(quantized.view(torch.uint8), ref_quantized.view(torch.uint8))

    # Published bytes, dequantized in fp32, quantized again: the same bytes. Those of the same rule
    # (on fp32 weights this time), and transformers' (FineGrainedFP8's quantizer: scale 1 / (448 / amax)),
    # where amax / 448 of the dequantized tile misses the scale by one ulp now and then.
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    transformers_quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config()))
    missed = 0
    for _ in range(3):
        original = torch.randn(512, 640) * torch.rand(1) * 0.1
        theirs = transformers_quantizer._quantize_one("w.weight", original)
        for published, published_scale in (
            reference_quantize_fp8(original),
            (theirs["w.weight"], theirs["w.weight_scale_inv"]),
        ):
            values = reference_fp8(published, published_scale)
            again, again_scale = quantize_fp8(values)
            assert torch.equal(again.view(torch.uint8), published.view(torch.uint8))
            assert torch.equal(again_scale, published_scale)
            naive = values.unflatten(1, (5, 128)).unflatten(0, (4, 128)).abs().amax(dim=(1, 3)) / 448
            missed += int((naive != published_scale).sum())
    assert missed > 0  # the tiles amax / 448 alone would not give back


def test_fp8_of_ue8m0_scales_comes_back_with_the_same_values():
    """V3.1's powers of two: the same bytes where the tile's largest code is above 224; a tile whose
    largest is 224 x 2^k is the same numbers as 448 x 2^(k-1), and comes back so."""
    weight = torch.randn(256, 384)
    tiles = weight.unflatten(1, (3, 128)).unflatten(0, (2, 128))
    scale = torch.pow(2.0, torch.ceil(torch.log2(tiles.abs().amax(dim=(1, 3)) / 448)))
    quantized = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)
    values = reference_fp8(quantized, scale)
    again, again_scale = quantize_fp8(values)
    assert torch.equal(reference_fp8(again, again_scale), values)
    largest = quantized.float().abs().unflatten(1, (3, 128)).unflatten(0, (2, 128)).amax(dim=(1, 3))
    assert torch.equal(again_scale[largest > 224], scale[largest > 224])


def test_mxfp4_quantization_is_the_ocp_rule_and_its_output_comes_back_bit_for_bit(monkeypatch):
    monkeypatch.setattr(formats, "_ROWS", 4)  # quantized 4 rows at a time
    weight = torch.randn(3, 6, 96)
    weight[0, 0, :32] = 0  # a zero group: byte 0
    weight[0, 1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4)  # ties and saturation
    weight[0, 2, :32] = -weight[0, 1, :32]
    weight = weight.bfloat16()
    blocks, scales = quantize_mxfp4(weight)
    ref_blocks, ref_scales = reference_quantize_mxfp4(weight)
    assert blocks.shape == (3, 6, 3, 16) and scales.shape == (3, 6, 3) and scales[0, 0, 0] == 0
    assert torch.equal(blocks, ref_blocks) and torch.equal(scales, ref_scales)
    values = reference_mxfp4(blocks, scales)
    assert torch.equal(
        values[0, 1, :8], torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    )  # floor(log2 7) - 2 = 0
    again_blocks, again_scales = quantize_mxfp4(values)
    assert torch.equal(again_blocks, blocks) and torch.equal(again_scales, scales)


# ---- methods moemesh does not read -------------------------------------------------------------
UNSUPPORTED = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "hqq": {"quant_method": "hqq"},
    "quanto": {"quant_method": "quanto", "weights": "int8"},
    "int4 compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
    },
    "channel fp8 compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
    },
    "static fp8": {**FP8, "activation_scheme": "static"},
    "per-tensor fp8": {**FP8, "weight_block_size": None},
    "e5m2 fp8": {**FP8, "fmt": "e5m2"},
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_another_method_is_one_line_before_anything_is_read(tmp_path, capsys, case):
    source = tmp_path / "source"
    source.mkdir()
    config = {"model_type": "qwen3_moe", "hidden_size": 32, "quantization_config": UNSUPPORTED[case]}
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors").write_bytes(b"not read")  # reading it would fail otherwise
    with pytest.raises(CheckpointError, match="is not supported; moemesh reads mxfp4") as error:
        read_model_config(source)
    assert "\n" not in str(error.value)
    name = UNSUPPORTED[case]["quant_method"]
    assert f"{name!r}" in str(error.value) or name == "compressed-tensors" or name == "fp8"
    for argv in (
        ["convert", str(source), str(tmp_path / "dst")],
        ["convert", str(source), str(tmp_path / "dst"), "--quantize", "fp8"],
        ["generate", "--checkpoint", str(source), "--prompt", "def "],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and "not supported" in err
        assert not (tmp_path / "dst").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["source"]
