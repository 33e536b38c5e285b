"""Fully-sharded data parallelism — generalized tensor parallelism — on FSDP2
(`torch.distributed.fsdp.fully_shard`), on top of the expert and tensor parallel shards.

Each rank stores 1/dp_shard of what EP and TP leave it: the dense weights are split over the
dp_shard × ep ranks (all of which hold them whole otherwise), the experts over the dp_shard ranks
that hold the same experts. dp_replicate, when > 1, keeps whole copies of these shards (HSDP).
The optimizer then keeps its moments for the shard only.

Units: every decoder block, its expert bank apart (it lives on a different group of ranks), and
the root (embedding, final norm, LM head). Before a unit runs, its weights are all-gathered (in
`param_dtype`, bf16 on GPU); after backward, its gradients are reduce-scattered in fp32 (in the
weights' own dtype when they are stored in bf16) and summed, not averaged: each rank's loss is
already its share of the global one (`rank_loss`). With `prefetch`, block i's forward issues the
all-gathers of block i+1 and of its experts (two buffers, one block ahead), and block i's
backward those of block i-1.

FSDP splits each tensor on a dimension that no other axis already splits (experts are split on
dim 0 over ep, a TP shard on its `tp_dim`; the fused gate_up bank is stored as two halves along
its rows) and that the shard count divides evenly, so that a checkpoint can describe every rank's
piece as nested `Shard`s of the full tensor (`parallel/stored.py`). A tensor without such a
dimension stays whole on each rank and `reduce_gradients` sums its gradient.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moemesh.models.transformer import DecoderLayer, MoECausalLM
from moemesh.parallel.expert import is_expert_parameter
from moemesh.parallel.mesh import Mesh, ParallelDims
from moemesh.parallel.pieces import record_piece, records_kept
from moemesh.parallel.stored import packed_dim


def apply_fsdp(
    model: MoECausalLM,
    mesh: Mesh,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    root: nn.Module | None = None,
) -> list[str]:
    """Shard `model` in place over dp_shard (after `apply_ep`, `apply_tp` and
    `apply_data_parallel`, and a pipeline's cut). `param_dtype`: the dtype weights are gathered and
    computed in (None: their own). `reshard_after_forward`: free a block's gathered weights after
    its forward and gather them again for backward (less memory, more communication). `root`: the
    module whose forward runs the model (default: the model; a pipeline rank's stages module).
    Returns the names of the parameters left whole."""
    dims = mesh.dims
    if dims.dp_shard == 1:
        return []
    shard_dims, whole = {}, []
    for name, param in model.named_parameters():
        dim = shard_dim(name, param, dims)
        if dim is None:
            whole.append(name)
        else:
            shard_dims[id(param)] = dim
    ignored = {param for name, param in model.named_parameters() if name in whole}

    dense_mesh = mesh.fsdp_dense_mesh[_data_axes(dims, "dp_shard_ep")]
    expert_mesh = mesh.device_mesh[_data_axes(dims, "dp_shard")]
    # Gradients are summed in fp32, unless the weights themselves are stored in a narrower type
    # (bf16 weights and AdamW state): that run computes and keeps its gradients in it anyway.
    # (Under LoRA the trained adapters', not the frozen base's.)
    params = list(model.parameters())
    storage = next((p for p in params if p.requires_grad), params[0]).dtype
    policy = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=storage if storage.itemsize < 4 else torch.float32
    )

    def shard(module: nn.Module, on, reshard: bool) -> FSDPModule:
        fully_shard(
            module,
            mesh=on,
            reshard_after_forward=reshard,
            mp_policy=policy,
            ignored_params=ignored,
            shard_placement_fn=lambda param: Shard(shard_dims[id(param)]),
        )
        return module

    units = []  # per block: (its expert bank or None, the block)
    with records_kept(model):  # FSDP replaces the parameters
        for layer in model.model.layers:
            if not isinstance(layer, DecoderLayer):  # a layer another pipeline rank holds
                continue
            experts = shard(layer.mlp.experts, expert_mesh, reshard_after_forward) if layer.is_moe else None
            units.append((experts, shard(layer, dense_mesh, reshard_after_forward)))
        root = shard(root or model, dense_mesh, False)  # its weights are needed again first thing in backward

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            if hasattr(module, "set_force_sum_reduction_for_comms"):  # torch >= 2.12; gloo has no PREMUL_SUM
                module.set_force_sum_reduction_for_comms(True)
    if prefetch and dims.pp == 1:  # a pipeline interleaves blocks of different micro-batches
        _prefetch_one_block_ahead(root, units)
    for param in model.parameters():
        if isinstance(param, DTensor):  # a shard: chunk `coordinate` of dim `dim` (evenly divided)
            dim, mesh_dims = param.placements[-1].dim, param.device_mesh.ndim
            coordinate, size = param.device_mesh.get_local_rank(mesh_dims - 1), param.to_local().shape[dim]
            record_piece(param, param, dim, torch.arange(coordinate * size, (coordinate + 1) * size))
    return whole


def shard_dim(name: str, param: torch.Tensor, dims: ParallelDims) -> int | None:
    """The dimension FSDP splits `param` on, or None if it must stay whole (see the module doc)."""
    expert = is_expert_parameter(name)
    parts = dims.dp_shard if expert else dims.dp_shard * dims.ep
    taken = set()
    if expert and dims.ep > 1:
        taken.add(0)
    if (halves := packed_dim(name)) is not None:
        taken.add(halves % param.dim())  # stored as its gate and up halves (`stored.py`)
    if hasattr(param, "tp_dim"):
        taken.add(param.tp_dim)
    return next((d for d in range(param.dim()) if d not in taken and param.shape[d] % parts == 0), None)


def _data_axes(dims: ParallelDims, shard_axis: str) -> tuple[str, ...]:
    # FSDP takes a 1-D mesh (shard) or a 2-D one (replicate, shard): HSDP.
    return ("dp_replicate", shard_axis) if dims.dp_replicate > 1 else (shard_axis,)


def _prefetch_one_block_ahead(model: FSDPModule, units: list[tuple[FSDPModule | None, FSDPModule]]) -> None:
    def gather(i: int) -> list[FSDPModule]:
        experts, block = units[i]
        return [block] if experts is None else [block, experts]

    model.set_modules_to_forward_prefetch(gather(0))
    for i, (_, block) in enumerate(units):
        if i + 1 < len(units):
            block.set_modules_to_forward_prefetch(gather(i + 1))
        if i > 0:  # backward reaches block i-1's experts first
            block.set_modules_to_backward_prefetch(gather(i - 1)[::-1])
