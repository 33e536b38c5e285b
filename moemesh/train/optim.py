"""AdamW and its learning-rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio."""

from __future__ import annotations

import math

import torch
from torch import nn

from moemesh.config import TrainConfig


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    # Norm scales and biases are not decayed: pulling them towards 0 fights their role (a norm
    # weight of 0 switches its channel off) and brings no regularisation worth having.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # On a GPU the fused kernel: one pass over all parameters instead of a pass per arithmetic
    # step, which for a bf16 model of billions of parameters is tens of milliseconds a step.
    fused = all(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.betas), eps=1e-8, fused=fused or None)


def lr_factor(step: int, train: TrainConfig) -> float:
    """Multiplier of train.lr for optimizer step `step` (0-based)."""
    if step < train.warmup_steps:
        return (step + 1) / train.warmup_steps
    decay_steps = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return train.min_lr_ratio + (1 - train.min_lr_ratio) * cosine


def build_scheduler(optimizer: torch.optim.Optimizer, train: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, train))
