"""How evenly each MoE layer spread a training step's tokens over its experts, for metrics.jsonl
(and TensorBoard / W&B). From the (token, slot) choices each router counted over the step's
training forwards (`models.moe.count_load`), summed over the batch ranks (each routes its own
tokens) and the pipeline ranks (each holds its own layers), so every rank of every layout gets the
same numbers. Per MoE layer i, relative to the mean load per expert (the step's choices / experts):

    expert_load_max/layer_i   the busiest expert's load (1: perfectly even; E: every token to one)
    expert_load_min/layer_i   the idlest expert's load (0: an expert no token chose)

and `expert_load_max` / `expert_load_min`, those of the worst layer. They read the counts; the
router-bias rule (`router_bias.py`) clears them after each step.
"""

from __future__ import annotations

import torch

from moemesh.models import MoECausalLM
from moemesh.parallel import comm
from moemesh.parallel.mesh import Mesh


@torch.no_grad()
def expert_load_metrics(model: MoECausalLM, mesh: Mesh, device: torch.device) -> dict[str, float]:
    """The step's load statistics (collective over the batch and pipeline groups); {} for a model
    without MoE layers."""
    config = model.config
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    if not moe_layers:
        return {}
    loads = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.long, device=device)
    for i, layer in enumerate(model.model.layers):  # a pipeline rank holds some; the others are Identity
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        if getattr(router, "expert_load", None) is not None:
            loads[i] = router.expert_load
    comm.all_reduce_sum_([loads], mesh.group("batch"), kind="metrics")
    comm.all_reduce_sum_([loads], mesh.group("pp"), kind="metrics")
    loads = loads[moe_layers].double()
    mean = loads.mean(dim=1).clamp_min(1e-12)  # a layer that saw no token (a step of none) has all zeros
    highest, lowest = (loads.amax(dim=1) / mean).tolist(), (loads.amin(dim=1) / mean).tolist()
    metrics = {"expert_load_max": max(highest), "expert_load_min": min(lowest)}
    for i, high, low in zip(moe_layers, highest, lowest):
        metrics[f"expert_load_max/layer_{i}"] = high
        metrics[f"expert_load_min/layer_{i}"] = low
    return metrics
