"""Model FLOPs utilisation: the FLOPs a step needs by the model's arithmetic, over what the GPU
could do at its dense bf16 tensor-core peak (the usual convention, also for fp32 runs)."""

from __future__ import annotations

import torch

from moemesh.models import MoECausalLM

# Dense bf16 peak per GPU, by a piece of torch.cuda.get_device_name(); first match wins.
_PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),  # also GH200
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
]


def flops_per_token(model: MoECausalLM, seq_len: int) -> float:
    """Forward + backward FLOPs per trained token (PaLM's 6N + 12·L·H·Q·T): 6 per active
    parameter that multiplies (the embedding lookup does not), plus attention scores and values.
    A frozen parameter (LoRA's base) needs no weight gradient: 4 (forward, input gradient)."""
    config = model.config
    active = model.num_params(active=True)
    frozen = _active_frozen(model)
    if not config.tie_word_embeddings:
        active -= model.model.embed_tokens.weight.numel()
        if not model.model.embed_tokens.weight.requires_grad:
            frozen -= model.model.embed_tokens.weight.numel()
    context = min(seq_len, config.sliding_window or seq_len)
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.attention_head_dim * context
    return 6 * active - 2 * frozen + attention


def _active_frozen(model: MoECausalLM) -> float:
    """The frozen parameters one token uses (an expert bank's at its top-k share)."""
    share = model.config.num_experts_per_tok / model.config.num_experts if model.config.num_experts else 1.0
    return sum(
        p.numel() * (share if ".mlp.experts." in name else 1.0)
        for name, p in model.named_parameters()
        if not p.requires_grad
    )


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPUs included)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for piece, peak in _PEAK_BF16_FLOPS if piece in name), None)
