"""Tensors of a safetensors checkpoint before they are read: their shape and dtype are known, and
any block of them can be read — only that block's bytes, through safetensors' own slices
(`safe_open(...).get_slice`).

A family's code that renames and re-lays a checkpoint's tensors (stacking per-expert weights into a
bank, GPT-OSS's transpose and de-interleave, moemesh/checkpoint/hf.py) runs unchanged on `Lazy`
values: `torch.cat`, `torch.stack`, indexing with slices, `transpose` and `contiguous` build a
recipe instead of data. A rank then reads the block it keeps (`read(index)`, per dim the
rows in the whole tensor) — its experts, its TP slice, its FSDP shard — through the recipe.
A quantized tensor is one too (`quantized.py`): it reads the quantized elements and the scales
of the block asked for, and gives it dequantized.

Reads cost what they touch: along each dim the rows from the first to the last wanted one are
read, except that one dim wanted in a few separate runs (the gate and up halves of a TP slice of a
fused bank) is read run by run. Limit: a strided pattern (GPT-OSS's interleaved gate|up) reads its
whole span, twice what is kept.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # block-FP8 checkpoints (checkpoint/quantized.py)
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):  # one-byte power-of-two scales
    _DTYPES["F8_E8M0"] = torch.float8_e8m0fnu
_MAX_RUNS = 16  # a dim wanted in at most this many separate runs is read run by run


class Lazy:
    shape: torch.Size
    dtype: torch.dtype

    def read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...] | None = None) -> None:
        """Copy the block of rows index[d] of each dim d (1-D int64, increasing; None: everything)
        into `out` (any device and dtype), piece by piece: no temporary holds the whole block, only
        one stored tensor's piece at a time."""
        self._read_into(out, self._index(index))

    def _index(self, index) -> tuple[torch.Tensor, ...]:
        if index is None:
            return tuple(torch.arange(n) for n in self.shape)
        return tuple(torch.as_tensor(i, dtype=torch.long) for i in index)

    def _read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    # ---- the torch surface the families' conversions use ------------------------------------------
    def __getitem__(self, key) -> Lazy:
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (self.ndim - len(key) + 1) + key[at + 1 :]
        out = self
        for d, item in enumerate(key):
            if not isinstance(item, slice):
                raise TypeError(f"a lazy checkpoint tensor takes slices only, got {item!r}")
            positions = torch.arange(self.shape[d])[item]
            if len(positions) != self.shape[d]:
                out = _Indexed(out, d, positions)
        return out

    def transpose(self, dim0: int, dim1: int) -> Lazy:
        return _Transposed(self, dim0 % self.ndim, dim1 % self.ndim)

    def contiguous(self) -> Lazy:
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.cat, torch.stack):
            tensors = list(args[0])
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            return _Joined(tensors, dim, stacked=func is torch.stack)
        raise TypeError(f"{func.__name__} is not defined on lazy checkpoint tensors")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype})"


class SafetensorsFiles:
    """Every tensor of some safetensors files, lazily. Keeps only the file read last open: the
    pages of a file that were read stay resident (and count as the process's) while it is open,
    so a load that goes through the files in order holds at most one file's worth of them."""

    def __init__(self, files: list[Path]):
        self._open: dict[Path, object] = {}
        self.tensors: dict[str, Stored] = {}
        for file in files:
            reader = self.handle(file)
            for key in reader.keys():
                piece = reader.get_slice(key)
                self.tensors[key] = Stored(self, file, key, torch.Size(piece.get_shape()), _DTYPES[piece.get_dtype()])

    def handle(self, file: Path):
        if file not in self._open:
            self._open.clear()
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file]


class Stored(Lazy):
    def __init__(self, files: SafetensorsFiles, file: Path, key: str, shape: torch.Size, dtype: torch.dtype):
        self.files, self.file, self.key, self.shape, self.dtype = files, file, key, shape, dtype

    def _read_into(self, out: torch.Tensor, index: tuple[torch.Tensor, ...]) -> None:
        out.copy_(self._block(index))

    def _block(self, index: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if not self.shape:
            return self.files.handle(self.file).get_tensor(self.key)
        boxes = [(int(i.min()), int(i.max()) + 1) if len(i) else (0, 0) for i in index]
        runs = [_runs(i) for i in index]
        split = next((d for d, r in enumerate(runs) if 1 < len(r) <= _MAX_RUNS), None)
        if split is None:
            block = self._box(boxes)
        else:  # one dim in a few runs: read each (index increasing, so the runs come in its order)
            block = torch.cat([self._box(boxes[:split] + [run] + boxes[split + 1 :]) for run in runs[split]], split)
        for d, (i, (start, stop)) in enumerate(zip(index, boxes)):
            if d != split and len(i) != stop - start:
                block = block.index_select(d, i - start)
        return block

    def _box(self, boxes: list[tuple[int, int]]) -> torch.Tensor:
        piece = self.files.handle(self.file).get_slice(self.key)
        return piece[tuple(slice(a, b) for a, b in boxes)]


def _runs(index: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of consecutive values of an increasing index, as (start, stop)."""
    if len(index) == 0:
        return [(0, 0)]
    breaks = (torch.nonzero(index.diff() != 1).flatten() + 1).tolist()
    starts, stops = [0, *breaks], [*breaks, len(index)]
    return [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops)]


class _Indexed(Lazy):
    """Rows `positions` of `source` along `dim`."""

    def __init__(self, source: Lazy, dim: int, positions: torch.Tensor):
        self.source, self.dim_, self.positions = source, dim, positions
        self.shape = source.shape[:dim] + (len(positions),) + source.shape[dim + 1 :]
        self.dtype = source.dtype

    def _read_into(self, out, index):
        index = list(index)
        index[self.dim_] = self.positions[index[self.dim_]]
        self.source._read_into(out, tuple(index))


class _Transposed(Lazy):
    def __init__(self, source: Lazy, dim0: int, dim1: int):
        self.source, self.dims = source, (dim0, dim1)
        shape = list(source.shape)
        shape[dim0], shape[dim1] = shape[dim1], shape[dim0]
        self.shape, self.dtype = torch.Size(shape), source.dtype

    def _read_into(self, out, index):
        index = list(index)
        a, b = self.dims
        index[a], index[b] = index[b], index[a]
        self.source._read_into(out.transpose(a, b), tuple(index))


class _Joined(Lazy):
    """torch.cat (or, `stacked`, torch.stack) of `sources` along `dim`."""

    def __init__(self, sources: list[Lazy], dim: int, stacked: bool):
        first = sources[0]
        ndim = first.ndim + stacked
        self.sources, self.dim_, self.stacked = sources, dim % ndim, stacked
        sizes = [1 if stacked else s.shape[self.dim_] for s in sources]
        self.offsets = torch.tensor([0, *sizes]).cumsum(0)
        shape = list(first.shape)
        if stacked:
            shape.insert(self.dim_, len(sources))
        else:
            shape[self.dim_] = int(self.offsets[-1])
        self.shape, self.dtype = torch.Size(shape), first.dtype

    def _read_into(self, out, index):
        wanted = index[self.dim_]
        which = torch.searchsorted(self.offsets, wanted, right=True) - 1
        for s in which.unique().tolist():
            here = torch.nonzero(which == s).flatten()  # where in `out` this source's rows go
            rest = list(index)
            if self.stacked:  # one position per source
                del rest[self.dim_]
                self.sources[s]._read_into(out.select(self.dim_, int(here[0])), tuple(rest))
                continue
            rest[self.dim_] = wanted[here] - self.offsets[s]
            # `index` increases, so a source's rows are one run of `out`
            self.sources[s]._read_into(out.narrow(self.dim_, int(here[0]), len(here)), tuple(rest))


def map_leaves(tensor: Lazy, leaf) -> Lazy | None:
    """The same recipe over other leaves: `leaf(t)` for each tensor read from a file (or a
    quantized one, `quantized.py`), a Lazy of its shape; None where `leaf` gives None for any."""
    if isinstance(tensor, _Indexed | _Transposed):
        source = map_leaves(tensor.source, leaf)
        if source is None:
            return None
        if isinstance(tensor, _Indexed):
            return _Indexed(source, tensor.dim_, tensor.positions)
        return _Transposed(source, *tensor.dims)
    if isinstance(tensor, _Joined):
        sources = [map_leaves(s, leaf) for s in tensor.sources]
        return None if any(s is None for s in sources) else _Joined(sources, tensor.dim_, tensor.stacked)
    return leaf(tensor)


class Columns(Lazy):
    """The column (last-dim index) of every element of `source` where it is stored: what a
    recipe's reshuffles made of each element's place, as int64."""

    def __init__(self, source: Lazy):
        self.shape, self.dtype = source.shape, torch.int64

    def _read_into(self, out, index):
        out.copy_(index[-1].expand(out.shape))
