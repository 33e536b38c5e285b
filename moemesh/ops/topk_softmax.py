"""The router's choice in one kernel: softmax over the experts in fp32, the top k, optionally
renormalised over the k.

    probs = softmax(logits.float());  weights, ids = topk(probs, k);  weights /= weights.sum()

Eagerly that is four or five kernels (softmax, top-k, sum, divide) of a microsecond or two of
work each; decoding runs it once per MoE layer per token, where such launches are most of the
time (vLLM's `topk_softmax` fuses the same). One Triton program per token holds the row whole,
takes the maximum k times (the lowest index among equal values first) and writes weights and ids
in descending order, as `torch.topk` does.

Limits: no gradient (routing for inference: the training router keeps autograd's ops), and the
row must fit one tile (E <= 4096). No router statistics: the load-balancing loss is not needed
while decoding.
"""

import torch

from moemesh.ops.backend import block_size, tl, triton, use_triton


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"topk_softmax: need logits [T, E] and 0 < k <= E, got {tuple(logits.shape)} and k={k}")
    if use_triton(logits) and logits.shape[1] <= 4096:
        return topk_softmax_triton(logits, k, renormalize)
    return topk_softmax_reference(logits, k, renormalize)


def topk_softmax_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax_triton(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.contiguous()
    tokens, experts = logits.shape
    weights = logits.new_empty(tokens, k, dtype=torch.float32)
    ids = logits.new_empty(tokens, k, dtype=torch.long)
    if tokens:
        _topk_softmax_kernel[(tokens,)](
            logits,
            weights,
            ids,
            experts,
            K=k,
            BLOCK_E=block_size(experts),
            BLOCK_K=block_size(k, smallest=2),
            RENORMALIZE=renormalize,
        )
    return weights, ids


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    experts,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + token * experts + cols, mask=cols < experts, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(cols < experts, e / tl.sum(e, axis=0), -1.0)  # padding never wins
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):
        best = tl.max(probs, axis=0)
        index = tl.min(tl.where(probs == best, cols, BLOCK_E), axis=0)
        chosen_w = tl.where(slots == j, best, chosen_w)
        chosen_i = tl.where(slots == j, index.to(tl.int64), chosen_i)
        probs = tl.where(cols == index, -2.0, probs)
    if RENORMALIZE:
        chosen_w = chosen_w / tl.sum(tl.where(slots < K, chosen_w, 0.0), axis=0)
    tl.store(weights_ptr + token * K + slots, chosen_w, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, chosen_i, mask=slots < K)
