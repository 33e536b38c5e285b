"""DeepSeek-V3's auxiliary-loss-free load balancing (arXiv:2412.19437, section 2.1.2): after each
optimizer step, every MoE layer's expert-choice bias moves a fixed step toward balance,

    e_score_correction_bias[e] += rate · sign(mean load − load[e]),

where load[e] counts the (token, slot) choices of expert e in that layer over the step's whole
global batch. The routers add up their own choices over the step's micro-batches
(`GroupLimitedRouter.expert_load`); here they are summed over the data-parallel ranks, the "batch"
group: each of its ranks routes its own tokens over all experts (under EP too, the router being
replicated), while TP ranks share their tokens and are not in it. The counts are integers, summed
exactly, so every rank of every layout ends with the same bias.
"""

from __future__ import annotations

import torch
from torch import nn

from moemesh.parallel import comm


@torch.no_grad()
def update_router_bias(model: nn.Module, rate: float, group) -> None:
    """Apply the rule to every router with a correction bias (none: nothing happens), with the
    loads counted since the last call, and start counting afresh (every router, with a bias or
    not: its counts zeroed in place, `models.moe.count_load`). rate 0 only clears the counts."""
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    loads = None
    if routers and rate != 0:
        loads = torch.stack(  # [layers, E], a copy: the counts are zeroed below
            [
                torch.zeros(r.e_score_correction_bias.shape, dtype=torch.long, device=r.e_score_correction_bias.device)
                if r.expert_load is None
                else r.expert_load
                for r in routers
            ]
        )
    for router in model.modules():  # every router counts its choices (`models.moe.count_load`)
        if getattr(router, "expert_load", None) is not None:
            router.expert_load.zero_()
    if loads is None:
        return
    comm.all_reduce_sum_([loads], group, kind="router_load")
    # sign(total / E − load), in integers: exact however large the batch
    direction = torch.sign(loads.sum(dim=1, keepdim=True) - loads.shape[1] * loads)
    for router, step in zip(routers, direction):
        router.e_score_correction_bias.add_(step.to(router.e_score_correction_bias.dtype), alpha=rate)
