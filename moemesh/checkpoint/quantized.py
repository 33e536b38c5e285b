"""The quantized formats that Hub checkpoints are published in: read exactly, on the tile grid, and
written the way their tools write them.

Why: the flagship checkpoints of several families ship only quantized. moemesh trains and serves
in full precision, so it reads their weights as the published formula defines them, in fp32
(then the model's dtype), and writes a model back in the same layout.

- Block FP8 (DeepSeek-V3/R1, Qwen3-*-FP8, Kimi-K2's layout too: transformers' `fp8`; llm-compressor's
  compressed-tensors `block` strategy): an e4m3 tensor [..., out, in] and one scale per tile of
  128 x 128 (`weight_block_size`), [..., ceil(out/128), ceil(in/128)] in F32, BF16 or F16 (V3.1's
  `scale_fmt: ue8m0`: powers of two, still stored F32, or one byte E8M0): w = fp8 * scale, in fp32,
  the tiles at the bottom and right edges partial (DeepSeek-V3's kv_a_proj_with_mqa is 576 rows).
- MXFP4 (gpt-oss's experts, the OCP Microscaling format): blocks U8 [..., out, in/32, 16], two
  E2M1 codes a byte (element 2j in the low nibble, 2j+1 in the high), codes 0-7 the values 0, .5,
  1, 1.5, 2, 3, 4, 6 and 8-15 their negatives; scales U8 [..., out, in/32], E8M0: 2^(byte - 127).
  Exact in fp32 (and in bf16): a code times a power of two.

Reading (`BlockFp8`, `Mxfp4`): `Lazy` tensors of the dequantized shape. A rank that reads a block
of one (its TP rows or columns, its experts: `lazy.py`) reads the fp8 elements of that block (for
MXFP4 the 16-byte groups holding its columns) and the scales of the tiles covering it, nothing
else; a split that cuts a tile or a 32-group in the middle reads that tile's scale (that group's
bytes) and keeps its own part. Temporaries hold one expert's matrix, at most `_ROWS` rows of it.

Writing (`quantize_fp8`, `quantize_mxfp4`), the rounding chosen:
- FP8: scale = amax / 448 per tile in fp32 (DeepSeek's and llm-compressor's rule; transformers'
  FineGrainedFP8 computes 1 / (448 / amax), one ulp away from it for about a third of amaxes),
  elements w / scale clamped to +-448 and rounded to nearest even (torch's cast, what all of them
  do); an all-zero tile gets scale 1 (transformers' choice). One refinement, for the round trip:
  w = fp8 * scale rounds in fp32, so the dequantized tile's amax / 448 is its scale again only when
  the scale was itself of that form; of transformers' scales ~9% come back one ulp off. So the
  scale is the first of amax / 448, its two fp32 neighbours and the power of two above it (V3.1's
  ue8m0) under which every element of the tile is reproduced exactly (fp8 * scale == w), else
  amax / 448: a tile that came quantized gets its own scale back and the same bytes; a tile of a
  bf16 or fp32 model, which no such scale reproduces, gets amax / 448.
- MXFP4: the OCP MX v1.0 scale, 2^(floor(log2(amax)) - 2) per 32-group (the exponent of amax less
  E2M1's largest exponent), elements rounded to the nearest E2M1 value, ties to even, saturating
  at +-6 (OCP's conversion; the sign kept on zeros, as triton_kernels keeps it); an all-zero group
  gets byte 0. Why this one: it is the specification's, and it is a fixed point: every group it
  writes has largest code 4 or 6, so its dequantized values give back the same scale and codes.
  triton_kernels' `downcast_to_mxfp_torch` (what transformers' `quantize_to_mxfp4` calls, on a
  GPU) rounds the scale up instead, 2^ceil(log2(amax / 6)), and rounds halves away from zero:
  it never clips the largest element (OCP clips (6, 8) x scale to 6) but writes groups of
  largest code 3, which no rule of the values alone can give back (a group of largest code 3 at
  2^k is the same numbers as code 6 at 2^(k-1)): those come back with the same values, not the
  same bytes.

Limits: FP8 is written in 128 x 128 tiles with F32 scales (Qwen3's releases store BF16: theirs
come back with the same values, as F32). The round trip starts from fp32: in bf16 an FP8 product
rounds. An all-zero tile or group comes back with scale 1 (byte 0) whatever it was stored with;
a ue8m0 tile whose largest code is 224 comes back as 448 at half the scale (the same values).
Activation scales (`activation_scheme: static`) and any other method are refused (`scheme_of`),
not approximated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from moemesh.checkpoint.lazy import Lazy
from moemesh.errors import CheckpointError
from moemesh.ops.quantized_weight import E8M0, MX_GROUP, QuantizedWeight, dequantize_reference

FP8_MAX = 448.0  # e4m3's largest finite value
_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, getattr(torch, "float8_e8m0fnu", torch.float32))
_ROWS = 2048  # rows dequantized at a time

SUPPORTED = (
    "mxfp4 (gpt-oss), fp8 with block scales (DeepSeek-V3/R1, Qwen3-FP8) and compressed-tensors "
    "8-bit float block quantization"
)


# ---- the method check --------------------------------------------------------------------------
@dataclass(frozen=True)
class Scheme:
    """A `quantization_config` of a kind moemesh reads."""

    method: str  # "mxfp4", "fp8" or "compressed-tensors"
    block: tuple[int, int] = (128, 128)  # FP8 tile: rows, columns
    not_converted: tuple[str, ...] = ()  # modules_to_not_convert (compressed-tensors: ignore)

    @property
    def scale_suffix(self) -> str:
        """The name of an FP8 weight's scale, beside `weight`."""
        return "weight_scale" if self.method == "compressed-tensors" else "weight_scale_inv"

    def converts(self, module: str) -> bool:
        """False for a module the config leaves unquantized: its tensors are read as they are."""
        if self.method == "compressed-tensors":  # llm-compressor: a module's name, or "re:" and a regex
            return not any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in self.not_converted)
        # transformers' should_convert_module: a regex from the start to a module boundary, or a suffix
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{p}){boundary}", module) or module.endswith(p) for p in self.not_converted)


def scheme_of(hf: dict, source) -> Scheme | None:
    """The quantization of a `config.json` dict (None: none); CheckpointError, in one line naming
    it, for any other method or variant than those moemesh reads."""
    config = hf.get("quantization_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise CheckpointError(f"{source}: quantization_config is not a JSON object")
    method = config.get("quant_method")
    if method == "mxfp4":
        return Scheme("mxfp4", not_converted=tuple(config.get("modules_to_not_convert") or ()))
    if method == "fp8":
        return _fp8_scheme(config, source)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(config, source)
    raise CheckpointError(
        f"{source}: quantization_config quant_method {method!r} is not supported; moemesh reads {SUPPORTED}"
    )


def _fp8_scheme(config: dict, source) -> Scheme:
    def refuse(what: str):
        raise CheckpointError(
            f"{source}: fp8 quantization_config with {what} is not supported; moemesh reads {SUPPORTED}"
        )

    if config.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):
        refuse(f"fmt {config['fmt']!r}")
    if str(config.get("activation_scheme", "dynamic")).lower() != "dynamic":
        refuse(f"activation_scheme {config['activation_scheme']!r} (static activation scales)")
    if config.get("scale_fmt", "float") not in ("float", "ue8m0", None):
        refuse(f"scale_fmt {config['scale_fmt']!r}")
    if config.get("expert_dtype", "fp8") != "fp8":
        refuse(f"expert_dtype {config['expert_dtype']!r}")
    block = config.get("weight_block_size")
    if block is None:
        refuse("one scale per tensor (weight_block_size null)")
    not_converted = config.get("modules_to_not_convert") or config.get("ignored_layers") or ()
    return Scheme("fp8", _block(block, source), tuple(not_converted))


def _compressed_tensors_scheme(config: dict, source) -> Scheme:
    def refuse(what: str):
        raise CheckpointError(
            f"{source}: compressed-tensors quantization_config with {what} is not supported; moemesh reads {SUPPORTED}"
        )

    if config.get("format", "float-quantized") != "float-quantized":
        refuse(f"format {config['format']!r}")
    if config.get("quantization_status", "compressed") != "compressed":
        refuse(f"quantization_status {config['quantization_status']!r}")
    if config.get("kv_cache_scheme"):
        refuse("a kv_cache_scheme")
    groups = config.get("config_groups") or {}
    if not groups:
        refuse("no config_groups")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") or {}
        kind = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"))
        if kind != (8, "float", "block"):
            refuse(f"group {name!r} of {kind[0]}-bit {kind[1]} weights, strategy {kind[2]!r}")
        if not weights.get("symmetric", True) or weights.get("dynamic", False):
            refuse(f"group {name!r} of asymmetric or dynamic weights")
        activations = group.get("input_activations")
        if activations and not activations.get("dynamic"):
            refuse(f"group {name!r} of static input activation scales")
        if group.get("output_activations"):
            refuse(f"group {name!r} of quantized output activations")
        blocks.add(_block(weights.get("block_structure"), source))
    if len(blocks) > 1:
        refuse(f"groups of different block structures {sorted(blocks)}")
    return Scheme("compressed-tensors", blocks.pop(), tuple(config.get("ignore") or ()))


def _block(block, source) -> tuple[int, int]:
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{source}: an FP8 block size must be two positive integers, got {block!r}")
    return tuple(block)


# ---- dequantization, whole tensors -------------------------------------------------------------
def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """fp8 [..., out, in] times the scale of its tile, in fp32."""
    rows, cols = weight.shape[-2:]
    expanded = scale.float().repeat_interleave(block[0], -2)[..., :rows, :]
    return weight.float() * expanded.repeat_interleave(block[1], -1)[..., :cols]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks U8 [..., out, G, 16] and scales U8 [..., out, G] -> fp32 [..., out, 32 G]."""
    return dequantize_reference(QuantizedWeight("mxfp4", blocks, scales), torch.float32)


# ---- quantization, whole tensors ---------------------------------------------------------------
def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> (e4m3 [..., out, in], F32 scales [..., ceil(out/bm), ceil(in/bn)]): the rule
    of the module docstring. A band of whole tile rows at a time, so that temporaries stay small."""
    band = max(1, _ROWS // block[0]) * block[0]
    pieces = [_quantize_fp8(w, block) for w in weight.split(band, dim=-2)]
    return torch.cat([q for q, _ in pieces], dim=-2), torch.cat([s for _, s in pieces], dim=-2)


def _quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float()
    rows, cols = w.shape[-2:]
    (bm, bn), lead = block, w.shape[:-2]
    padded = torch.nn.functional.pad(w, (0, -cols % bn, 0, -rows % bm))  # zeros count for no amax
    tiles = padded.unflatten(-1, (-1, bn)).unflatten(-3, (-1, bm))  # [..., TR, bm, TC, bn]
    amax = tiles.abs().amax(dim=(-3, -1))
    if not torch.isfinite(amax).all():
        raise ValueError("a weight that is not finite cannot be quantized")
    first = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    pow2 = torch.exp2(torch.ceil(torch.log2(first)))  # exact for the powers of two it gives
    candidates = [first, torch.nextafter(first, torch.full_like(first, math.inf)), torch.nextafter(first, amax * 0)]
    scale, found = first.clone(), torch.zeros_like(first, dtype=torch.bool)
    for candidate in [*candidates, pow2]:
        exact = (_fp8(tiles, candidate).float() * _grid(candidate) == tiles).all(dim=-1).all(dim=-2)
        scale = torch.where(exact & ~found, candidate, scale)
        found |= exact
    quantized = _fp8(tiles, scale).flatten(-2).flatten(-3, -2)[..., :rows, :cols]
    return quantized.reshape(*lead, rows, cols).contiguous(), scale.contiguous()


def _grid(scale: torch.Tensor) -> torch.Tensor:
    return scale.unsqueeze(-1).unsqueeze(-3)  # [..., TR, 1, TC, 1] against tiles [..., TR, bm, TC, bn]


def _fp8(tiles: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (tiles / _grid(scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


# E2M1's magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours, and whether a value
# exactly at one goes up (the upper neighbour's code is even: round half to even)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (False, True, False, True, False, True, False)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] (in a multiple of 32) -> (blocks U8 [..., out, in/32, 16], scales U8
    [..., out, in/32]): the OCP rule of the module docstring, `_ROWS` rows at a time."""
    pieces = [_quantize_mxfp4(w) for w in weight.split(_ROWS, dim=-2)]
    return torch.cat([b for b, _ in pieces], dim=-3), torch.cat([s for _, s in pieces], dim=-2)


def _quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    groups = weight.float().unflatten(-1, (-1, MX_GROUP))
    amax = groups.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("a weight that is not finite cannot be quantized")
    _, exponent = torch.frexp(amax)  # amax = m * 2^exponent, m in [0.5, 1): floor(log2(amax)) = exponent - 1
    shared = torch.where(amax > 0, exponent - 1 - 2, torch.full_like(exponent, -127)).clamp(-127, 127)
    scales = (shared + 127).to(torch.uint8)
    x = groups / E8M0.to(groups.device)[scales.long()].unsqueeze(-1)
    magnitude = x.abs()
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for midpoint, up in zip(_MIDPOINTS, _TIES_UP):
        code += (magnitude >= midpoint if up else magnitude > midpoint).to(torch.uint8)  # saturates at 6
    code |= torch.signbit(x).to(torch.uint8) << 3
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), scales.contiguous()


# ---- reading a rank's block, on the tile grid --------------------------------------------------
class BlockFp8(Lazy):
    """A block-FP8 tensor read dequantized: `weight` e4m3 [..., out, in], `scale` per tile."""

    def __init__(self, name: str, weight: Lazy, scale: Lazy, block: tuple[int, int]):
        rows, cols = weight.shape[-2:] if weight.ndim >= 2 else (None, None)
        expected = (*weight.shape[:-2], -(-rows // block[0]), -(-cols // block[1])) if rows is not None else None
        if weight.dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name} is stored as {weight.dtype}, not float8_e4m3fn, beside its scale")
        if expected is None or tuple(scale.shape) != expected or scale.dtype not in _SCALE_DTYPES:
            raise CheckpointError(
                f"{name}: scale of shape {tuple(scale.shape)} ({scale.dtype}) for a weight of shape "
                f"{tuple(weight.shape)}; tiles of {block[0]}x{block[1]} need {expected} in F32, BF16 or F16"
            )
        self.weight, self.scale, self.block = weight, scale, block
        self.shape, self.dtype = weight.shape, torch.float32

    def _read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
        for piece, at in _pieces(out, index):
            quantized = torch.empty([len(i) for i in at], dtype=self.weight.dtype)
            self.weight._read_into(quantized, at)
            piece.copy_(quantized.float() * self.element_scales(at))

    def element_scales(self, at: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The fp32 scale of each element of the block `at` (its tile's)."""
        *lead, rows, cols = at
        tile_rows, tile_cols = rows // self.block[0], cols // self.block[1]
        grid_rows, grid_cols = tile_rows.unique(), tile_cols.unique()  # sorted: an index for `lazy`
        scale = torch.empty([*(len(i) for i in lead), len(grid_rows), len(grid_cols)], dtype=torch.float32)
        self.scale._read_into(scale, (*lead, grid_rows, grid_cols))
        scale = scale.index_select(-2, torch.searchsorted(grid_rows, tile_rows))
        return scale.index_select(-1, torch.searchsorted(grid_cols, tile_cols))

    def parts(self) -> tuple[Lazy, Lazy]:
        """The e4m3 codes and each element's fp32 scale, as tensors of this one's shape."""
        return self.weight, _Part(self, torch.float32, lambda at: self.element_scales(at))


class Mxfp4(Lazy):
    """An MXFP4 tensor read dequantized, [..., out, in]: `blocks` [..., out, in/32, 16], `scales`."""

    def __init__(self, name: str, blocks: Lazy, scales: Lazy):
        if (
            blocks.dtype != torch.uint8
            or scales.dtype != torch.uint8
            or blocks.ndim < 3
            or blocks.shape[-1] != MX_GROUP // 2
            or tuple(blocks.shape[:-1]) != tuple(scales.shape)
        ):
            raise CheckpointError(
                f"{name}: MXFP4 blocks {tuple(blocks.shape)} ({blocks.dtype}) and scales {tuple(scales.shape)} "
                f"({scales.dtype}) do not fit: blocks U8 [..., out, in/32, 16] and scales U8 [..., out, in/32]"
            )
        self.blocks, self.scales = blocks, scales
        self.shape, self.dtype = torch.Size((*blocks.shape[:-2], blocks.shape[-2] * MX_GROUP)), torch.float32

    def _read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
        for piece, at in _pieces(out, index):
            blocks, scales, where = self._groups(at)
            piece.copy_(dequantize_mxfp4(blocks, scales).index_select(-1, where))

    def _groups(self, at: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The bytes and scales of the 32-groups holding the block `at`, and where its columns are
        among the groups' elements."""
        *lead, rows, cols = at
        groups = (cols // MX_GROUP).unique()
        blocks = torch.empty([*(len(i) for i in lead), len(rows), len(groups), MX_GROUP // 2], dtype=torch.uint8)
        self.blocks._read_into(blocks, (*lead, rows, groups, torch.arange(MX_GROUP // 2)))
        scales = torch.empty(blocks.shape[:-1], dtype=torch.uint8)
        self.scales._read_into(scales, (*lead, rows, groups))
        return blocks, scales, torch.searchsorted(groups, cols // MX_GROUP) * MX_GROUP + cols % MX_GROUP

    def parts(self) -> tuple[Lazy, Lazy]:
        """Each element's E2M1 code (U8 0-15) and its group's E8M0 scale byte, as tensors of this
        one's shape."""

        def codes(at):
            blocks, _, where = self._groups(at)
            return torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-3).index_select(-1, where)

        def scales(at):
            _, scales, where = self._groups(at)
            return scales.repeat_interleave(MX_GROUP, -1).index_select(-1, where)

        return _Part(self, torch.uint8, codes), _Part(self, torch.uint8, scales)


class _Part(Lazy):
    """Something of each element of a quantized tensor (`parts`), read by the same pieces."""

    def __init__(self, source: Lazy, dtype: torch.dtype, block):
        self.shape, self.dtype, self.block = source.shape, dtype, block

    def _read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
        for piece, at in _pieces(out, index):
            piece.copy_(self.block(at))


def _pieces(out: torch.Tensor, index: tuple[torch.Tensor, ...]):
    """(part of `out`, its index) by leading entry (one expert at a time) and by `_ROWS` rows."""
    if any(len(i) == 0 for i in index):
        return
    if len(index) > 2:
        for k in range(len(index[0])):
            for piece, at in _pieces(out.select(0, k), index[1:]):
                yield piece.unsqueeze(0), (index[0][k : k + 1], *at)
        return
    rows, cols = index
    for start in range(0, len(rows), _ROWS):
        yield out.narrow(0, start, min(_ROWS, len(rows) - start)), (rows[start : start + _ROWS], cols)
