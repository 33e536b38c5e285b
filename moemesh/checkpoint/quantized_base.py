"""A LoRA run's frozen base, or a model loaded for generate and serve, read as it is published:
each weight a quantized checkpoint stores in block FP8 or MXFP4 becomes an
`ops.quantized_weight.QuantizedWeight` of this rank's block, its codes and scales as stored,
instead of a dense parameter. `keep_for_inference` also quantizes a dense checkpoint's
projections and expert banks at load (`--quantize fp8`): block FP8 on the whole tensor's
128 x 128 tile grid by the published rule (`quantized.quantize_fp8`), so that every layout keeps
the codes and scales one process would.

Why: the base trains no further, so it can stay in a quarter (MXFP4) or half (FP8) of bf16's
bytes: gpt-oss-120b's experts are ~61 GB in MXFP4 and 230 in bf16. The products dequantize it per
use (`ops/quantized_weight.py`), to the values the dense read gives (`quantized.py`), so the run
computes what it computes on the dequantized base.

How a rank's block is read: the checkpoint's recipe for a weight (the families' stacking,
transposes and de-interleaving, `lazy.py`) is replayed over the quantized tensors' parts — each
element's code, its scale, and the column it is stored at — for the rank's rows and columns (its
experts, its TP slice), one expert at a time. The columns say whether the block's rows are
contiguous runs of stored columns on one tile grid (they are for every published family: the
recipes move rows, not columns), and where the first column sits in its tile; each row's scales
are then taken from the elements at tile starts, and MXFP4's codes packed back into bytes.

Limits: a weight whose block the parts do not describe — columns that are not one contiguous run,
an MXFP4 block cutting a 32-group (a TP split of gpt-oss's experts at tp > 2), a weight mixing
quantized and plain tensors — is read dense, as without this, and counted in the run's first
lines. Parameters that FSDP shards are not swapped (the caller refuses dp_shard > 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moemesh.checkpoint.hf import read_quantization
from moemesh.checkpoint.lazy import Columns, Lazy, map_leaves
from moemesh.checkpoint.load import hf_state, is_hf_directory
from moemesh.checkpoint.quantized import BlockFp8, Mxfp4, quantize_fp8
from moemesh.errors import ConfigError
from moemesh.models.moe import EXPERT_BANKS, Experts
from moemesh.ops.quantized_weight import FP8_TILE, MX_GROUP, QuantizedWeight
from moemesh.parallel.pieces import full_index
from moemesh.parallel.tensor import RowwiseLinear


@dataclass
class KeptQuantized:
    """What `keep_quantized` did: counts and bytes, for the run's first lines."""

    kept: dict[str, int] = field(default_factory=dict)  # format -> weights kept quantized
    kept_bytes: int = 0  # their codes and scales
    dense_bytes: int = 0  # what they would take dense, in their dtype
    read_dense: list[str] = field(default_factory=list)  # quantized in the checkpoint, read dense

    def describe(self, per_product: bool = True) -> str:
        """One line; `per_product`: a LoRA base's products dequantize it (else the decoding
        kernels read the codes, the other products dequantize)."""
        kinds = ", ".join(f"{n} in {fmt}" for fmt, n in sorted(self.kept.items()))
        line = (
            f"kept quantized: {kinds or 'no weight'} ({_gib(self.kept_bytes)} instead of "
            f"{_gib(self.dense_bytes)}), "
            + ("dequantized per product" if per_product else "read in their codes by the decoding kernels")
        )
        if self.read_dense:
            line += f"; {len(self.read_dense)} read dense (their blocks cut a tile or group: {self.read_dense[0]}, ...)"
        return line


def _gib(count: int) -> str:
    return f"{count / 2**30:.2f} GiB"


def keep_quantized(model: nn.Module, tensors: dict[str, Lazy], device: torch.device) -> KeptQuantized:
    """On `model` laid out on the meta device, before it is materialised: each frozen parameter
    whose checkpoint tensor (`tensors`, under the model's names) is quantized becomes a
    QuantizedWeight of this rank's block on `device`, standing for the parameter's dtype."""
    report = KeptQuantized()
    for module_name, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if param is None or param.requires_grad or full not in tensors:
                continue
            parts = quantized_parts(tensors[full])
            if parts is None:
                continue
            weight = read_block(parts, full_index(param), param.dtype)
            if weight is None:
                report.read_dense.append(full)
                continue
            _swap(module, name, weight, device, report)
    return report


def _swap(module: nn.Module, name: str, weight: QuantizedWeight, device: torch.device, report: KeptQuantized) -> None:
    """The parameter `name` of `module` replaced by `weight`, moved to `device`, and counted."""
    param = module._parameters.pop(name)
    weight = QuantizedWeight(
        weight.format, weight.codes.to(device), weight.scales.to(device), param.dtype, weight.offset
    )
    setattr(module, name, weight)
    report.kept[weight.format] = report.kept.get(weight.format, 0) + 1
    report.kept_bytes += weight.nbytes
    report.dense_bytes += weight.numel() * param.element_size()


@dataclass
class Parts:
    format: str
    codes: Lazy  # each element's code: e4m3, or U8 0-15
    scales: Lazy  # each element's scale: fp32, or the E8M0 byte
    columns: Lazy  # each element's stored column


def quantized_parts(tensor: Lazy) -> Parts | None:
    """The parts of a checkpoint tensor whose every stored tensor is quantized in one format
    (None otherwise)."""
    formats = set()

    def leaf(stored: Lazy, part: int) -> Lazy | None:
        if isinstance(stored, BlockFp8) and stored.block[1] == FP8_TILE:
            formats.add("fp8")
        elif isinstance(stored, Mxfp4):
            formats.add("mxfp4")
        else:
            return None
        return Columns(stored) if part == 2 else stored.parts()[part]

    pieces = [map_leaves(tensor, lambda t, p=p: leaf(t, p)) for p in range(3)]
    if any(p is None for p in pieces) or len(formats) != 1:
        return None
    return Parts(formats.pop(), *pieces)


def read_block(parts: Parts, index: tuple[torch.Tensor, ...], dtype: torch.dtype) -> QuantizedWeight | None:
    """The block `index` (rows per dim in the whole tensor) of a quantized tensor, on the host, one
    leading entry (expert) at a time; None where its columns do not keep the stored grid."""
    lead = index[:-2]
    if len(lead) > 1:
        return None
    entries = [None] if not lead else [i.view(1) for i in lead[0]]
    codes, scales, offsets = [], [], set()
    for entry in entries:
        at = (*([] if entry is None else [entry]), *index[-2:])
        piece = _read_entry(parts, at)
        if piece is None:
            return None
        codes.append(piece[0])
        scales.append(piece[1])
        offsets.add(piece[2])
    if len(offsets) != 1:
        return None
    join = torch.cat if lead else (lambda pieces: pieces[0])
    return QuantizedWeight(parts.format, join(codes), join(scales), dtype, offsets.pop())


def _read_entry(parts: Parts, at: tuple[torch.Tensor, ...]):
    shape = [len(i) for i in at]
    columns = torch.empty(shape, dtype=torch.int64)
    parts.columns._read_into(columns, at)
    width = shape[-1]
    first = columns[..., :1]
    one_run = torch.equal(columns, first + torch.arange(width))
    if width == 0 or not one_run or not torch.equal(first, first.flatten()[0].expand_as(first)):
        return None
    group = FP8_TILE if parts.format == "fp8" else MX_GROUP
    offset = int(first.flatten()[0]) % group
    if parts.format == "mxfp4" and (offset or width % MX_GROUP):
        return None
    codes = torch.empty(shape, dtype=torch.float8_e4m3fn if parts.format == "fp8" else torch.uint8)
    parts.codes._read_into(codes, at)
    scales = torch.empty(shape, dtype=torch.float32 if parts.format == "fp8" else torch.uint8)
    parts.scales._read_into(scales, at)
    starts = torch.arange(-offset, width, group).clamp(min=0)  # each tile's (group's) first column here
    kept = scales.index_select(-1, starts)
    if not torch.equal(kept.repeat_interleave(group, -1)[..., offset : offset + width], scales):
        return None
    if parts.format == "mxfp4":
        codes = (codes[..., 0::2] | (codes[..., 1::2] << 4)).unflatten(-1, (-1, MX_GROUP // 2))
    return codes, kept.contiguous(), offset


def keep_base_quantized(model: nn.Module, path: str | Path, device: torch.device) -> KeptQuantized | None:
    """`keep_quantized` from the checkpoint at `path` when it is a quantized Hugging Face
    directory (None otherwise: nothing to keep)."""
    directory = Path(path)  # a run directory holds moemesh checkpoints: not resolved here, nor verified twice
    if not is_hf_directory(directory) or read_quantization(directory) is None:
        return None
    if any(isinstance(p, DTensor) for p in model.parameters() if not p.requires_grad):
        raise ConfigError(
            "lora.keep_quantized: FSDP (parallel.dp_shard > 1) does not shard a quantized base; "
            "set lora.keep_quantized = false to train on it dequantized, or lay it out with ep/tp"
        )
    return keep_quantized(model, hf_state(directory, model.config), device)


# What `--quantize fp8` quantizes: every linear projection but the head, and the expert banks.
QUANTIZED_AT_LOAD = ("fp8",)


def keep_for_inference(
    model: nn.Module, path: str | Path, device: torch.device, quantize: str | None = None
) -> KeptQuantized | None:
    """Before `model` (laid out on meta, its parameters frozen) is materialised for generation:
    the weights the checkpoint at `path` stores quantized kept as QuantizedWeights of this rank's
    block (`keep_quantized`), and with `quantize="fp8"` the projections and expert banks still
    dense quantized from the checkpoint's values (`quantize_fp8_block`). None: nothing kept (a
    dense checkpoint without `quantize`)."""
    if quantize is not None and quantize not in QUANTIZED_AT_LOAD:
        raise ConfigError(f"--quantize {quantize}: moemesh quantizes at load to {', '.join(QUANTIZED_AT_LOAD)}")
    directory = Path(path)  # a run directory holds moemesh checkpoints: not resolved here, nor verified twice
    if not is_hf_directory(directory):
        if quantize is not None:
            raise ConfigError(
                f"--quantize {quantize} reads a Hugging Face directory; {path} is a moemesh checkpoint "
                "(write one with `moemesh convert`, or give --quantize to none)"
            )
        return None
    tensors = hf_state(directory, model.config)
    report = keep_quantized(model, tensors, device) if read_quantization(directory) is not None else KeptQuantized()
    if quantize is None:
        return report if report.kept or report.read_dense else None
    for module_name, module in model.named_modules():
        for name in _quantizable(module_name, module):
            param = module._parameters.get(name)
            full = f"{module_name}.{name}"
            if param is None or full not in tensors:
                continue
            weight = quantize_fp8_block(tensors[full], full_index(param), param.dtype)
            if weight is None:
                report.read_dense.append(full)
                continue
            _swap(module, name, weight, device, report)
    return report


def _quantizable(module_name: str, module: nn.Module) -> tuple[str, ...]:
    """The parameters of `module` that `--quantize fp8` quantizes: a linear layer's weight (a
    tensor-parallel row split's too; not the head's: the logits stay as trained), an expert bank's
    two matrices (not their biases)."""
    if isinstance(module, Experts):
        return EXPERT_BANKS
    if isinstance(module, (nn.Linear, RowwiseLinear)) and module_name.rsplit(".", 1)[-1] != "lm_head":
        return ("weight",)
    return ()


def quantize_fp8_block(tensor: Lazy, index: tuple[torch.Tensor, ...], dtype: torch.dtype) -> QuantizedWeight | None:
    """The block `index` (rows per dim) of the dense checkpoint tensor `tensor` in block FP8 on
    the whole tensor's 128 x 128 tiles: each tile that the block touches read whole (one leading
    entry, an expert, at a time), quantized by `quantize_fp8`, the block's codes and its rows'
    scales kept. None where the block's columns are not one contiguous run."""
    *lead, rows, cols = index
    if len(lead) > 1 or len(cols) == 0 or not torch.equal(cols, cols[0] + torch.arange(len(cols))):
        return None
    height, width = tensor.shape[-2:]
    tiles = torch.unique(rows // FP8_TILE)
    region_rows = torch.cat([torch.arange(t * FP8_TILE, min((t + 1) * FP8_TILE, height)) for t in tiles.tolist()])
    first, last = int(cols[0]), int(cols[-1]) + 1
    start = first // FP8_TILE * FP8_TILE
    region_cols = torch.arange(start, min(-(-last // FP8_TILE) * FP8_TILE, width))
    place = torch.searchsorted(region_rows, rows)  # each row's place in the region
    codes, scales = [], []
    for entry in [None] if not lead else [i.view(1) for i in lead[0]]:
        at = (*([] if entry is None else [entry]), region_rows, region_cols)
        region = torch.empty([len(i) for i in at], dtype=torch.float32)
        tensor._read_into(region, at)
        code, scale = quantize_fp8(region if entry is None else region[0])
        codes.append(code[place][:, first - start : last - start])
        scales.append(scale[place // FP8_TILE])
    join = torch.stack if lead else (lambda pieces: pieces[0])
    return QuantizedWeight("fp8", join(codes).contiguous(), join(scales).contiguous(), dtype, first - start)
