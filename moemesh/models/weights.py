"""Weights copied into a model in place, tensor by tensor: how a training run hands its current
weights to an inference engine in the same process without writing a checkpoint
(`DecodeEngine.load_weights`; reinforcement learning's sample-train loop, examples/grpo.py).

In place: the model keeps its parameter tensors, so whatever holds them (a CUDA graph captured
over them, a tied embedding and LM head) sees the new values. Each copy casts to the target's
dtype and device (an fp32 trainer into a bf16 engine), and nothing is copied unless every name
and shape fits. The layouts must cut the same slices: under tensor or expert parallelism each rank
copies its own shard, of the same local shape, into its own engine — no collective
(tests/test_train_logprobs.py). An FSDP-sharded source
(DTensor shards) must be gathered first; this refuses it rather than copying a shard as a whole.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moemesh.models.lora import merged_state_dict


def copy_weights(model: nn.Module, source: nn.Module | Mapping[str, torch.Tensor]) -> int:
    """Copy `source` — a model (LoRA adapters merged on the way, the source left as it is) or a
    state dict — into `model`'s parameters and buffers, in place. ValueError naming the first
    names and shapes that do not fit, before anything is copied. Returns the tensors copied."""
    state = merged_state_dict(source) if isinstance(source, nn.Module) else dict(source)
    target = model.state_dict()
    missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    shapes = [
        f"{n} {tuple(state[n].shape)} into {tuple(t.shape)}"
        for n, t in target.items()
        if n in state and state[n].shape != t.shape
    ]
    sharded = [n for n, t in state.items() if isinstance(t, DTensor)]
    problems = [
        f"{len(names)} {what} ({'; '.join(names[:3])}{'; ...' if len(names) > 3 else ''})"
        for what, names in [
            ("missing", missing),
            ("unexpected", unexpected),
            ("of another shape", shapes),
            ("FSDP-sharded (gather them first)", sharded),
        ]
        if names
    ]
    if problems:
        raise ValueError("weights do not fit the model: " + ", ".join(problems) + "; nothing copied")
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(state[name])
    return len(target)
