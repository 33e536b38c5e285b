"""Deterministic model construction, for whatever part of the model a rank holds.

A model is made on the meta device (no memory, no time), laid out for its parallel layout
(`moemesh.parallel.parallelize`: experts, shards, pipeline stages), and only then materialised:
`to_empty` allocates what this rank keeps, and `init_weights` fills it — or a checkpoint is read
into it. This is the order torchtitan uses; no rank ever holds the whole model.

Every initial value is a function of the seed, the parameter's name and the element's index in the
*whole* tensor: a counter-based random number generator (a hash of the index, made normal by
Box–Muller), not a stream that must be drawn in order. So an expert, a TP slice or an FSDP shard
gets exactly the values one process gives it, whatever the layout, and a rank computes only its
own part, on its own device. The hash is integer arithmetic (the same bits on every device); log
and cos run in float64 and are then rounded, so CPUs and GPUs agree to the last bit of float32 but
in the rarest ties. Limit: a value depends only on its
index, so two tensors of the same name and shape start equal whatever the seed's other uses.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch

from moemesh.models.config import ModelConfig
from moemesh.models.transformer import MoECausalLM

# A parameter as a rank holds it: (the local tensor to fill, the whole tensor's shape, and per dim
# the indices in the whole tensor of the local rows along that dim — None: all of them).
LocalView = tuple[torch.Tensor, torch.Size, tuple[torch.Tensor, ...] | None]


def meta_model(config: ModelConfig, dtype: torch.dtype | None = None) -> MoECausalLM:
    """The model on the meta device: shapes, names and dtypes, no storage."""
    with torch.device("meta"):
        model = MoECausalLM(config)
    if dtype is not None:
        model.to(dtype)
    return model


def build(
    config: ModelConfig, seed: int = 0, device: torch.device | str | None = None, dtype: torch.dtype | None = None
) -> MoECausalLM:
    """The whole model, initialised from `seed`, on one device (one process; tests; tools)."""
    model = meta_model(config, dtype)
    model.to_empty(device=device or "cpu")
    model.tie_weights()
    init_weights(model, seed)
    return model


def whole(param: torch.Tensor) -> LocalView:
    return param, param.shape, None


@torch.no_grad()
def init_weights(
    model: MoECausalLM,
    seed: int,
    view: Callable[[torch.Tensor], LocalView] = whole,
    only: Callable[[str], bool] | None = None,
) -> None:
    """Fill every parameter and buffer this rank holds with its initial values. `view` gives a
    parameter's local part and where it sits in the whole tensor (a layout's; default: whole).
    `only`: the parameters to fill, by name (LoRA's adapters on a base read from a checkpoint);
    buffers are then left alone."""
    std = model.config.initializer_range
    for name, buffer in model.named_buffers() if only is None else ():  # DeepSeek-V3's correction bias at zero
        buffer.fill_(1.0 if name.endswith("layer_scalar") else 0.0)  # Gemma 4's layer_scalar at one
    for name, param in model.named_parameters():
        if only is not None and not only(name):
            continue
        local, shape, index = view(param)
        if name.endswith(("norm.weight", "gate.scale", "per_expert_scale")):  # multipliers start at one
            local.fill_(1.0)
        elif name.endswith((".bias", "_bias", "lora_B")):  # LoRA's B: the adapted model starts as the base
            local.zero_()
        elif name.endswith("lora_A"):
            fill_normal(local, lora_init_std(shape), parameter_seed(seed, name), shape, index)
        else:
            fill_normal(local, std, parameter_seed(seed, name), shape, index)


def lora_init_std(shape: torch.Size) -> float:
    """A LoRA A factor's std: the variance 1/(3·in) of PEFT's Kaiming-uniform bound 1/sqrt(in)."""
    return 1.0 / math.sqrt(3 * shape[-1])


def parameter_seed(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode())


_CHUNK = 1 << 24  # elements generated at once (int64 temporaries of 128 MiB)


def fill_normal(
    out: torch.Tensor, std: float, key: int, shape: torch.Size, index: tuple[torch.Tensor, ...] | None = None
) -> None:
    """out = the block `index` (per dim, indices into `shape`) of a tensor of `shape` whose element
    at flat index i is std · N(0, 1) drawn from (key, i) alone."""
    if out.numel() == 0:
        return
    device = out.device
    index = index or tuple(torch.arange(n) for n in shape)
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # Flat offsets of one local row (all dims but the first), then rows in chunks.
    inner = torch.zeros((), dtype=torch.long, device=device)
    for d in range(1, len(shape)):
        inner = inner[..., None] + index[d].to(device) * strides[d]
    rows = index[0].to(device) * strides[0] if shape else torch.zeros(1, dtype=torch.long, device=device)
    flat_out = out.view(len(rows), -1) if shape else out.view(1, 1)
    per_chunk = max(1, _CHUNK // max(1, inner.numel()))
    for start in range(0, len(rows), per_chunk):
        flat = rows[start : start + per_chunk, None] + inner.reshape(1, -1)
        flat_out[start : start + per_chunk] = (_standard_normal(flat, key) * std).to(out.dtype)


def _int64(value: int) -> int:
    """A 64-bit constant as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = _int64(0x9E3779B97F4A7C15), _int64(0xBF58476D1CE4E5B9), _int64(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> keeps the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash64(counter: torch.Tensor, key: int) -> torch.Tensor:
    """SplitMix64 (Steele, Lea and Flood 2014) of key + counter: 64 well-mixed bits per int64
    counter, computed with products that wrap modulo 2⁶⁴ as every CPU and GPU does them."""
    z = counter * _GOLDEN + _int64(key * _GOLDEN % (1 << 64))
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    return z ^ _shift_right(z, 31)


def _standard_normal(flat: torch.Tensor, key: int) -> torch.Tensor:
    """N(0, 1) in float64 for each flat index, from (key, index) alone: Box–Muller on the hash's
    two 24-bit halves."""
    h = hash64(flat, key)
    u1 = (_shift_right(h, 40) + 1).double() * 2.0**-24  # (0, 1]
    u2 = (h & 0xFFFFFF).double() * 2.0**-24  # [0, 1)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)
