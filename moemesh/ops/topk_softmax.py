"""The router's choice in one kernel: softmax over the experts in fp32, the top k, optionally
renormalised over the k.

    probs = softmax(logits.float());  weights, ids = topk(probs, k);  weights /= weights.sum()

Eagerly that is four or five kernels (softmax, top-k, sum, divide) of a microsecond or two of
work each; decoding runs it once per MoE layer per token, where such launches are most of the
time (vLLM's `topk_softmax` fuses the same). One Triton program per token holds the row whole,
takes the maximum k times (the lowest index among equal values first) and writes weights and ids
in descending order, as `torch.topk` does.

Training (`routed`) takes the same kernel with autograd around it: it also writes the
probabilities [T, E] (the load-balancing loss sums them; the backward reads them) and adds each
choice to a per-expert count (ones added atomically: exact in any order). Its backward is one
kernel a token too: the gradient of the renormalised weights back to the chosen probabilities,
plus that of the probabilities themselves, through the softmax. Eagerly the training router is
eight kernels forward and about as many backward, and activation checkpointing runs the forward
twice.

Limits: the row must fit one tile (E <= 4096). `topk_softmax` has no gradient and no router
statistics (the load-balancing loss is not needed while decoding).
"""

import torch

from moemesh.ops.backend import block_size, dependent_launch, tl, triton, use_triton, wait_for_inputs

# Each of the k choices one maximum of 64-bit keys (a probability's bits over its index reversed:
# the lowest index among equal probabilities first), in one warp where the row fits (its reductions
# without shared memory), rather than a maximum and then the lowest index at it in four warps. The
# 48-layer Qwen3-30B-A3B shape's decode step on an H200: 2.93 -> 2.88 ms at batch 1, 17.01 -> 16.95
# at 64 (docs/benchmarks.md, 2026-11-29). One warp sums the softmax's row in another order: the
# probabilities differ from four warps' by rounding, the same in the engine and the trainer (one
# kernel). False: the latter (for measuring).
PACKED_CHOICE = True


def topk_softmax(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"topk_softmax: need logits [T, E] and 0 < k <= E, got {tuple(logits.shape)} and k={k}")
    if use_triton(logits) and logits.shape[1] <= 4096:
        return topk_softmax_triton(logits, k, renormalize)
    return topk_softmax_reference(logits, k, renormalize)


def routed(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The training router's choice: logits [T, E] -> (probabilities [T, E] fp32, weights [T, k]
    fp32, expert ids [T, k] int64, choices per expert [E] fp32), with the gradient of the
    probabilities and the weights back to the logits."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1]:
        raise ValueError(f"routed: need logits [T, E] and 0 < k <= E, got {tuple(logits.shape)} and k={k}")
    if use_triton(logits) and logits.shape[1] <= 4096:
        return _Routed.apply(logits, k, renormalize)
    return routed_reference(logits, k, renormalize)


def routed_reference(
    logits: torch.Tensor, k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return probs, weights, ids, choice_counts(ids, probs.shape[-1])


def choice_counts(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The (token, slot) choices of each expert, fp32 [E] (index_add, which unlike bincount needs no
    device sync)."""
    with torch.no_grad():
        counts = torch.zeros(experts, device=ids.device, dtype=torch.float32)
        return counts.index_add_(0, ids.flatten(), torch.ones(ids.numel(), device=ids.device, dtype=torch.float32))


class _Routed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, k, renormalize):
        probs = logits.new_empty(logits.shape, dtype=torch.float32)
        counts = logits.new_zeros(logits.shape[1], dtype=torch.float32)
        weights, ids = topk_softmax_triton(logits, k, renormalize, probs, counts)
        ctx.mark_non_differentiable(ids, counts)
        ctx.save_for_backward(probs, weights, ids)
        ctx.renormalize, ctx.logits_dtype = renormalize, logits.dtype
        return probs, weights, ids, counts

    @staticmethod
    def backward(ctx, grad_probs, grad_weights, _ids, _counts):
        probs, weights, ids = ctx.saved_tensors
        tokens, experts = probs.shape
        k = weights.shape[1]
        grad_logits = probs.new_empty(tokens, experts, dtype=ctx.logits_dtype)
        if grad_weights is None:
            grad_weights = torch.zeros_like(weights)
        grad_weights = grad_weights.contiguous()
        has_grad_probs = grad_probs is not None
        if not has_grad_probs:
            grad_probs = probs  # not read
        if tokens:
            _routed_backward_kernel[(tokens,)](
                probs,
                weights,
                ids,
                grad_weights,
                grad_probs,
                grad_logits,
                experts,
                *grad_probs.stride(),  # an expanded gradient (of probs.sum(0)) has a row stride of 0
                K=k,
                BLOCK_E=block_size(experts),
                RENORMALIZE=ctx.renormalize,
                HAS_GRAD_PROBS=has_grad_probs,
            )
        return grad_logits, None, None


def topk_softmax_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax_triton(
    logits: torch.Tensor,
    k: int,
    renormalize: bool,
    probs: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """With `probs` [T, E] and `counts` [E] (zeros) given, also writes the probabilities and adds
    the choices per expert (training)."""
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
            probs_ptr=weights if probs is None else probs,  # not written without
            counts_ptr=weights if counts is None else counts,
            TRAINING=probs is not None,
            PACKED=PACKED_CHOICE,
            num_warps=1 if PACKED_CHOICE and experts <= 512 else 4,
            **dependent_launch(logits),
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
    probs_ptr,  # training: also the probabilities and the choices per expert
    counts_ptr,
    TRAINING: tl.constexpr,
    PACKED: tl.constexpr,
    GDC: tl.constexpr,
):
    wait_for_inputs(GDC)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + token * experts + cols, mask=cols < experts, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = tl.where(cols < experts, e / tl.sum(e, axis=0), -1.0)  # padding never wins
    if TRAINING:
        tl.store(probs_ptr + token * experts + cols, probs, mask=cols < experts)
    slots = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    chosen_i = tl.zeros([BLOCK_K], dtype=tl.int64)
    if PACKED:  # a probability's bits (>= 0: ordered as integers) over its reversed index, one max each
        keys = (probs.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - cols)
        for j in tl.static_range(K):
            key = tl.max(keys, axis=0)
            index = BLOCK_E - 1 - (key & 0xFFFFFFFF)
            chosen_w = tl.where(slots == j, (key >> 32).to(tl.int32).to(tl.float32, bitcast=True), chosen_w)
            chosen_i = tl.where(slots == j, index, chosen_i)
            keys = tl.where(cols == index, -1, keys)
    else:
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
    if TRAINING:  # ones: exact in any order
        tl.atomic_add(counts_ptr + chosen_i, tl.full([BLOCK_K], 1.0, tl.float32), mask=slots < K)


@triton.jit
def _routed_backward_kernel(
    probs_ptr,
    weights_ptr,
    ids_ptr,
    grad_weights_ptr,
    grad_probs_ptr,
    grad_logits_ptr,
    experts,
    grad_probs_stride_t,
    grad_probs_stride_e,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_GRAD_PROBS: tl.constexpr,
):
    """One token: the chosen probabilities' gradient from the weights' (through the
    renormalisation w = p / sum(p chosen)), added to the probabilities' own, then the softmax's
    backward: dlogits = p * (dp - sum(p * dp))."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    inside = cols < experts
    p = tl.load(probs_ptr + token * experts + cols, mask=inside, other=0.0)
    if HAS_GRAD_PROBS:
        at = grad_probs_ptr + token * grad_probs_stride_t + cols * grad_probs_stride_e
        dp = tl.load(at, mask=inside, other=0.0).to(tl.float32)
    else:
        dp = tl.zeros([BLOCK_E], dtype=tl.float32)
    dot = 0.0
    chosen = 1.0
    if RENORMALIZE:  # d/dp_j of w_i = p_i / S: (g_j - sum_i g_i w_i) / S
        chosen = 0.0
        for j in tl.static_range(K):
            dot += tl.load(grad_weights_ptr + token * K + j) * tl.load(weights_ptr + token * K + j)
            chosen += tl.load(probs_ptr + token * experts + tl.load(ids_ptr + token * K + j))
    for j in tl.static_range(K):
        g = (tl.load(grad_weights_ptr + token * K + j) - dot) / chosen
        dp += tl.where(cols == tl.load(ids_ptr + token * K + j), g, 0.0)
    grad = p * (dp - tl.sum(p * dp, axis=0))
    tl.store(grad_logits_ptr + token * experts + cols, grad.to(grad_logits_ptr.dtype.element_ty), mask=inside)
