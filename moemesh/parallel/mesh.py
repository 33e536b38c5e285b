"""Parallel dimensions -> a `DeviceMesh` with named axes (pp, dp_replicate, dp_shard, ep, tp).

The world is pp × dp_replicate × dp_shard × ep × tp ranks, tp innermost. Ranks on the
(dp_replicate, dp_shard, ep) cube are data-parallel for the dense part of the model: together they
form the "batch" group, and each takes a contiguous slice of every micro-batch. Expert weights are
split over ep. dp_replicate ranks hold whole copies of what they hold; dp_shard ranks split it
further with FSDP (`parallel/fsdp.py`): the dense weights over dp_shard × ep, the experts over
dp_shard.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moemesh.errors import ConfigError

AXES = ("pp", "dp_replicate", "dp_shard", "ep", "tp")
BATCH_AXES = ("dp_replicate", "dp_shard", "ep")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        for axis in AXES:
            if not isinstance(getattr(self, axis), int) or getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis} must be a positive integer, got {getattr(self, axis)!r}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.ep * self.tp

    @property
    def batch_size(self) -> int:
        """How many ranks take different slices of each micro-batch."""
        return self.dp_replicate * self.dp_shard * self.ep

    def describe(self) -> str:
        return " × ".join(f"{axis}={getattr(self, axis)}" for axis in AXES)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ConfigError(
                f"parallel layout {self.describe()} needs {self.world_size} processes, but {world_size} were launched"
            )


class Mesh:
    """The device mesh plus the process groups moemesh uses, created once (creating a group is
    itself a collective that every rank must join in the same order)."""

    def __init__(self, dims: ParallelDims, device_mesh: DeviceMesh | None, fsdp_dense_mesh: DeviceMesh | None = None):
        self.dims = dims
        self.device_mesh = device_mesh
        # The same ranks seen as (pp, dp_replicate, dp_shard·ep, tp): FSDP shards the dense
        # weights over the flattened dp_shard·ep axis, with dp_replicate as the HSDP replicas.
        self.fsdp_dense_mesh = fsdp_dense_mesh
        self._groups: dict[str, dist.ProcessGroup | None] = {axis: None for axis in (*AXES, "batch")}
        self._tp_copies: dict[int, DeviceMesh] = {}
        if device_mesh is not None:
            for axis in AXES:
                if getattr(dims, axis) > 1:
                    self._groups[axis] = device_mesh[axis].get_group()
            if dims.batch_size > 1:
                self._groups["batch"] = device_mesh[BATCH_AXES]._flatten("batch").get_group()

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """Process group of one axis or of "batch" (dp_replicate × dp_shard × ep); None where it
        has one rank."""
        return self._groups[axis]

    def tp_copies(self, copies: int) -> DeviceMesh | None:
        """The device mesh with its tp axis split in two, (tp_heads, tp_copies): tp // copies blocks
        of `copies` consecutive tp ranks, those that hold the same key/value head where tp exceeds
        an attention's key/value heads (`parallel/tensor.py`). None without a device mesh. Made at
        the first call for `copies` (torch's DeviceMesh._unflatten, as "batch" is `_flatten`'s) —
        a collective that makes process groups: `apply_tp` makes it on every rank, in order."""
        if self.device_mesh is None:
            return None
        if copies not in self._tp_copies:
            # The axis by its index: torch 2.11's _unflatten refuses a name it has (inverted check).
            self._tp_copies[copies] = self.device_mesh._unflatten(
                self.device_mesh.mesh_dim_names.index("tp"), (self.dims.tp // copies, copies), ("tp_heads", "tp_copies")
            )
        return self._tp_copies[copies]

    def rank(self, axis: str) -> int:
        if self.device_mesh is None:
            return 0
        if axis == "batch":
            rank = 0
            for name in BATCH_AXES:
                rank = rank * getattr(self.dims, name) + self.rank(name)
            return rank
        return self.device_mesh.get_local_rank(axis)


def init_mesh(dims: ParallelDims, timeout_s: float = 300.0, device_type: str | None = None) -> Mesh:
    """Join the process group torchrun describes (if any) and build the mesh. gloo on CPU, NCCL on
    GPU. Collectives that wait longer than `timeout_s` for a peer fail instead of hanging.
    `device_type` ("cpu" or "cuda"): the run's device (the trainer's train.device); by default that
    of a process group already joined (gloo: cpu), else a GPU when there is one. A CPU run on a
    machine with fewer GPUs than ranks must not ask each rank for a GPU of its own."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dims.check_world(world_size)
    if world_size == 1 and not dist.is_initialized():
        return Mesh(dims, None)
    if device_type is None and dist.is_initialized():
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    elif device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    mesh = init_device_mesh(device_type, tuple(getattr(dims, axis) for axis in AXES), mesh_dim_names=AXES)
    dense = None
    if dims.dp_shard > 1:
        dense = init_device_mesh(
            device_type,
            (dims.pp, dims.dp_replicate, dims.dp_shard * dims.ep, dims.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard_ep", "tp"),
        )
    return Mesh(dims, mesh, dense)
