"""Where the piece of a parameter that a rank keeps sits in the whole tensor.

Each step of a layout (EP keeps some experts, TP a slice of rows or columns — for the fused gate|up
bank two slices, FSDP a shard) narrows a parameter along one dim. The steps record it on the
parameter: `full_shape`, the whole tensor's shape, and `full_index`, per dim the indices in the
whole tensor of the rows this rank holds. A model made on the meta device can then be initialised
(`models/build.py: init_weights`) or read from a checkpoint piece by piece, each rank touching only
its own part, with the values one process has there. A parameter without the record is whole.
Pieces of different ranks may be the same rows (a key/value head copied on several tp ranks):
each reads or draws them alike.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moemesh.models.build import LocalView


@contextmanager
def records_kept(model: nn.Module):
    """Carry the records moemesh puts on parameters (pieces, TP dims, gradient tags) over to the
    objects that replace them inside the block (FSDP sharding, moving a sharded model)."""
    records = {name: dict(vars(param)) for name, param in model.named_parameters()}
    yield
    for name, param in model.named_parameters():
        for key, value in records[name].items():
            setattr(param, key, value)


def full_index(param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per dim, the indices in the whole tensor of what `param` holds (before any FSDP shard)."""
    index = getattr(param, "full_index", None)
    return index if index is not None else tuple(torch.arange(n) for n in param.shape)


def record_piece(piece: torch.Tensor, of: torch.Tensor, dim: int, positions: torch.Tensor) -> torch.Tensor:
    """Record on `piece` that it holds rows `positions` (of `of`'s dim `dim`) of the parameter `of`."""
    index = list(full_index(of))
    index[dim % len(index)] = index[dim % len(index)][positions]
    piece.full_shape = getattr(of, "full_shape", of.shape)
    piece.full_index = tuple(index)
    return piece


def local_view(param: torch.Tensor) -> LocalView:
    """This rank's tensor of `param` (an FSDP DTensor's local shard), the whole tensor's shape, and
    where the one sits in the other."""
    local = param.to_local() if isinstance(param, DTensor) else param
    return local, getattr(param, "full_shape", param.shape), getattr(param, "full_index", None)
