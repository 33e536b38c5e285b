"""Parallel dimensions -> a `DeviceMesh` with named axes (pp, dp, ep, tp).

The world is pp × dp × ep × tp ranks, tp innermost. Ranks on the (dp, ep) plane are
data-parallel for the dense part of the model: together they form the "batch" group, and each
takes a contiguous slice of every micro-batch. Expert weights are split over ep and replicated
over dp.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moemesh.errors import ConfigError

AXES = ("pp", "dp", "ep", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis} must be a positive integer, got {getattr(self, axis)!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def batch_size(self) -> int:
        """How many ranks take different slices of each micro-batch."""
        return self.dp * self.ep

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"parallel layout pp={self.pp} × dp={self.dp} × ep={self.ep} × tp={self.tp} needs "
                f"{self.world_size} processes, but {world_size} were launched")


class Mesh:
    """The device mesh plus the process groups moemesh uses, created once (creating a group is
    itself a collective that every rank must join in the same order)."""

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh | None):
        self.dims = dims
        self.device_mesh = device_mesh
        self._groups: dict[str, dist.ProcessGroup | None] = {axis: None for axis in (*AXES, "batch")}
        if device_mesh is not None:
            for axis in AXES:
                if getattr(dims, axis) > 1:
                    self._groups[axis] = device_mesh[axis].get_group()
            if dims.batch_size > 1:
                self._groups["batch"] = device_mesh["dp", "ep"]._flatten("batch").get_group()

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of one axis or of "batch" (dp × ep); None where it has one rank."""
        return self._groups[axis]

    def rank(self, axis: str) -> int:
        if self.device_mesh is None:
            return 0
        if axis == "batch":
            return self.rank("dp") * self.dims.ep + self.rank("ep")
        return self.device_mesh.get_local_rank(axis)


def init_mesh(dims: ParallelDims, timeout_s: float = 300.0) -> Mesh:
    """Join the process group torchrun describes (if any) and build the mesh. gloo on CPU, NCCL on
    GPU. Collectives that wait longer than `timeout_s` for a peer fail instead of hanging."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims.check_world(world_size)
    if world_size == 1 and not dist.is_initialized():
        return Mesh(dims, None)
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.ep, dims.tp), mesh_dim_names=AXES)
    return Mesh(dims, mesh)
