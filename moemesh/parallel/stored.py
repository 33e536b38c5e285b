"""How a model's (and its AdamW moments') tensors appear in a checkpoint, whatever the layout:
each as the full tensor, of which this rank presents its part as a DTensor with plain `Shard`
placements (experts on dim 0 over ep, a TP shard on its split dim over tp, an FSDP shard — a
DTensor of the EP/TP shard — on its dim over dp_shard, and for dense weights over ep too). A
key/value head that several tp ranks hold (`tp_copies`, `parallel/tensor.py`) is split over the
heads and `Replicate` over its copies, on the mesh `Mesh.tp_copies` unflattens tp into.
torch.distributed.checkpoint then writes every part once, under its place in the full tensor, and
loads into any other layout, one process included.

The fused expert bank gate_up_proj [E, 2I, H] is stored as two tensors [E, I, H], `.gate` and
`.up`, in every layout (and its bias [E, 2I], where a family has one, as two [E, I]; its LoRA B
factor [E, 2I, r] as two [E, I, r]): under TP a
rank holds a slice of the gate rows and the same slice of the up rows, two separate pieces of the
fused tensor that no single `Shard` describes. Both halves are views of the local tensor, so a
load writes straight into it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from moemesh.parallel.expert import is_expert_parameter
from moemesh.parallel.mesh import AXES, Mesh

HALVES = ("gate", "up")
# The fused expert tensors stored as their gate and up halves, and the dim the halves are on.
PACKED_DIMS = {".experts.gate_up_proj": -2, ".experts.gate_up_proj_bias": -1, ".experts.gate_up_proj_lora_B": -2}


def packed_dim(name: str) -> int | None:
    """The dim along which `name` packs its gate and up halves, or None."""
    return next((dim for suffix, dim in PACKED_DIMS.items() if name.endswith(suffix)), None)


def stored_state(state: dict, model: nn.Module | None = None, mesh: Mesh | None = None) -> dict:
    """`state` (model and optimizer state dicts, keyed by parameter name, among other entries) as
    it is saved and loaded: new dicts around the same tensors, or views of them. `model` is this
    rank's model on `mesh`; without it, the tensors of `state["model"]` are whole."""
    if model is None:
        names = {name: t for name, t in state.get("model", {}).items() if isinstance(t, torch.Tensor)}
    else:
        names = dict(model.named_parameters(remove_duplicate=False))

    def walk(value: dict, owner: str | None) -> dict:
        out = {}
        for key, item in value.items():
            name = key if key in names else owner  # optimizer moments sit under their parameter's name
            if isinstance(item, dict):
                out[key] = walk(item, name)
            elif name is not None and isinstance(item, torch.Tensor) and item.shape == names[name].shape:
                out.update(_stored(key, item, name, names[name], mesh))
            else:  # the optimizer step count, param_groups, scheduler and trainer state
                out[key] = item
        return out

    return walk(state, None)


def _stored(key: str, tensor: torch.Tensor, name: str, param: torch.Tensor, mesh: Mesh | None) -> dict:
    # mesh axis -> the dim it splits. Two axes on one dim nest in mesh order: the first splits first.
    splits = {}
    expert = is_expert_parameter(name)
    if isinstance(tensor, DTensor):  # FSDP's shard of this rank's EP/TP piece (`parallel/fsdp.py`)
        fsdp_dim = tensor.placements[-1].dim
        splits["dp_shard"] = fsdp_dim
        if not expert:
            splits["ep"] = fsdp_dim  # dense weights are sharded over dp_shard × ep, dp_shard-major
        tensor = tensor.to_local()
    if expert:
        splits["ep"] = 0
    if hasattr(param, "tp_dim"):
        splits["tp"] = param.tp_dim
    axes = [axis for axis in AXES if axis in splits and mesh is not None and getattr(mesh.dims, axis) > 1]
    placements = [Shard(splits[axis]) for axis in axes]
    device_mesh = None if mesh is None else mesh.device_mesh
    if "tp" in axes and (copies := getattr(param, "tp_copies", 1)) > 1:
        # A key/value head that `copies` tp ranks hold: split over the heads, the same on the
        # copies (DCP writes it once and reads it into each).
        device_mesh, at = mesh.tp_copies(copies), axes.index("tp")
        axes[at : at + 1], placements[at : at + 1] = ["tp_heads", "tp_copies"], [Shard(splits["tp"]), Replicate()]

    def full(part: torch.Tensor):
        if not axes:
            return part
        return DTensor.from_local(part, device_mesh[tuple(axes)], placements, run_check=False)

    if (dim := packed_dim(name)) is not None:
        return {f"{key}.{half}": full(part) for half, part in zip(HALVES, tensor.chunk(2, dim=dim))}
    return {key: full(tensor)}
