"""Cross-entropy of a linear head (`hidden @ weight.T`) that never holds the full [T, V] logits.

Same loss as `F.cross_entropy((hidden @ weight.T).float(), labels, ignore_index=...)`, plus an
optional z-loss `z_loss * mean(logsumexp(logits)**2)` over the non-ignored tokens. The tokens are
processed in chunks (as Liger-Kernel's fused linear cross-entropy does): for each chunk the logits
are computed in the hidden dtype, a kernel turns them *in place* into d loss / d logits and the
per-token loss, and two matmuls fold that into the gradients of `hidden` and `weight`. The forward
thus computes the gradients and stores them; the backward only scales them by the incoming
gradient. Peak extra memory: one logits chunk, grad_hidden [T, H] and an fp32 [V, H] accumulator,
which on a GPU the weight-gradient GEMM adds into directly (elsewhere, for bf16 weights, through one
bf16 [V, H] chunk product). Where the reference runs (CPU, MOEMESH_KERNELS=torch)
the full logits are materialised. The whole vocabulary must be on this rank (no vocab parallelism).

Choices:
- If no token has a valid label (or T = 0) the mean is taken as 0 with zero gradients, where
  F.cross_entropy would give NaN: an all-padding micro-batch must not poison a training run.
- Labels other than `ignore_index` must lie in [0, V), as for F.cross_entropy; on the GPU this is
  not checked (checking would cost a device sync).
- `reduction="sum"` returns the plain sum, for callers that divide by a global token count.
"""

import torch
import torch.nn.functional as F

from moemesh.ops.backend import block_size, tl, triton, use_triton

# A logits chunk holds at most this many elements (2**28: 512 MiB in bf16), and at least one row.
LOGITS_CHUNK_ELEMENTS = 2**28


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    z_loss: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """fp32 scalar loss of `hidden [T, H]` (or [..., H]) through `weight [V, H]` against `labels [T]`.
    `chunk_size` is the number of tokens per chunk (default: from LOGITS_CHUNK_ELEMENTS)."""
    hidden, labels = _check(hidden, weight, labels, reduction)
    if not use_triton(hidden):
        return linear_cross_entropy_reference(hidden, weight, labels, ignore_index, z_loss, reduction)
    return chunked_linear_cross_entropy(
        hidden, weight, labels, ignore_index, z_loss, reduction, chunk_size, cross_entropy_step_triton
    )


def linear_cross_entropy_reference(hidden, weight, labels, ignore_index=-100, z_loss=0.0, reduction="mean"):
    hidden, labels = _check(hidden, weight, labels, reduction)
    logits = hidden @ weight.T
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, or fp64 for gradcheck
    valid = labels != ignore_index
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    if z_loss:
        loss = loss + z_loss * torch.where(valid, torch.logsumexp(logits, dim=-1) ** 2, 0.0).sum()
    if reduction == "mean":
        loss = loss / valid.sum().clamp(min=1)
    return loss


def chunked_linear_cross_entropy(hidden, weight, labels, ignore_index, z_loss, reduction, chunk_size, step):
    """The chunked algorithm with a given per-chunk `step` (cross_entropy_step_triton or _torch)."""
    if chunk_size is None:
        chunk_size = LOGITS_CHUNK_ELEMENTS // max(weight.shape[0], 1)
    options = (ignore_index, float(z_loss), reduction, max(1, chunk_size), step)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _loss_and_gradients(hidden, weight, labels, *options, need_hidden=False, need_weight=False)[0]
    return _LinearCrossEntropy.apply(hidden, weight, labels, options)


def _check(hidden, weight, labels, reduction):
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        shapes = f"{tuple(hidden.shape)}, {tuple(weight.shape)}"
        raise ValueError(f"need hidden [..., H] and weight [V, H], got {shapes}")
    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if labels.shape[0] != hidden.shape[0]:
        raise ValueError(f"{labels.shape[0]} labels for {hidden.shape[0]} tokens")
    return hidden, labels


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, options):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        loss, grad_hidden, grad_weight = _loss_and_gradients(
            hidden, weight, labels, *options, need_hidden=need_hidden, need_weight=need_weight
        )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        # Out of place, so that a second backward (retain_graph) does not rescale the saved tensors.
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None


def _loss_and_gradients(
    hidden, weight, labels, ignore_index, z_loss, reduction, chunk_size, step, need_hidden, need_weight
):
    """(loss, grad of hidden or None, grad of weight or None), one chunk of tokens at a time."""
    num_tokens, labels = hidden.shape[0], labels.contiguous()
    loss_dtype = torch.promote_types(hidden.dtype, torch.float32)  # fp32 (fp64 for gradcheck)
    # d loss / d logits is scaled inside `step`, so the chunk gradients come out final.
    scale = torch.ones(1, dtype=loss_dtype, device=hidden.device)
    if reduction == "mean":
        scale /= (labels != ignore_index).sum().clamp(min=1)
    row_loss = torch.empty(num_tokens, dtype=loss_dtype, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    # fp32 accumulation over chunks: summing bf16 partial products would round once per chunk.
    accumulate = torch.promote_types(weight.dtype, torch.float32)
    grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if need_weight else None
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        chunk = hidden[start:end]
        logits = chunk @ weight.T  # [c, V]: the only vocabulary-sized buffer
        step(logits, labels[start:end], row_loss[start:end], scale, ignore_index, z_loss)  # logits := grad
        if need_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if need_weight:
            _add_product(grad_weight, logits.T, chunk)
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return row_loss.sum() * scale[0], grad_hidden, grad_weight


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, with acc fp32 and a, b possibly bf16. On a GPU the GEMM adds into acc itself
    (fp32 output, beta 1): no [V, H] bf16 product written and read back by a separate add, which
    at a 150k vocabulary costs a millisecond per chunk."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # a torch without GEMMs of a wider output
            pass
    acc += a @ b


def cross_entropy_step_torch(logits, labels, row_loss, scale, ignore_index, z_loss):
    """Reference for the kernel: writes each row's loss into `row_loss` and overwrites `logits`
    with scale * d(row loss)/d logits (zero rows for ignored labels)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(x, dim=-1)
    valid = labels != ignore_index
    label = torch.where(valid, labels, 0).unsqueeze(1)
    row_loss.copy_(torch.where(valid, lse - x.gather(1, label).squeeze(1) + z_loss * lse**2, 0.0))
    grad = torch.softmax(x, dim=-1) * (1.0 + 2.0 * z_loss * lse).unsqueeze(1)
    grad.scatter_add_(1, label, -torch.ones_like(label, dtype=grad.dtype))
    logits.copy_(grad * torch.where(valid, scale, 0.0).unsqueeze(1))


def cross_entropy_step_triton(logits, labels, row_loss, scale, ignore_index, z_loss):
    rows, vocab = logits.shape
    if rows == 0:
        return
    assert logits.is_contiguous() and labels.is_contiguous() and row_loss.is_contiguous()
    block = block_size(vocab, largest=32768)
    _cross_entropy_step_kernel[(rows,)](
        logits, labels, row_loss, scale, vocab, ignore_index, z_loss,
        BLOCK_V=block, num_warps=32 if block >= 32768 else max(4, block // 1024),
    )  # fmt: skip


@triton.jit
def _cross_entropy_step_kernel(
    logits_ptr, labels_ptr, row_loss_ptr, scale_ptr, vocab, ignore_index, z_loss, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)  # 64-bit: row * V passes 2**31 for big chunks
    logits_ptr += row * vocab
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target_logit = tl.load(logits_ptr + tl.where(valid, label, 0)).to(tl.float32)  # read before overwrite

    # Pass 1: online max and sum of exponentials -> logsumexp.
    m = float("-inf")
    d = 0.0
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)

    # Pass 2, in place: grad = scale * (softmax * (1 + 2 z lse) - onehot(label)); zero if ignored.
    scale = tl.where(valid, tl.load(scale_ptr), 0.0)
    softmax_factor = 1.0 + 2.0 * z_loss * lse
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) * softmax_factor - tl.where(cols == label, 1.0, 0.0)
        tl.store(logits_ptr + cols, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)

    loss = lse - target_logit + z_loss * lse * lse
    tl.store(row_loss_ptr + row, tl.where(valid, loss, 0.0).to(row_loss_ptr.dtype.element_ty))
