"""Expert GEMV: each row times the weight of the expert it chose, reading only chosen weights.

    out[i] = weight[expert_ids[i]] @ x[i]        x [N, K], weight [E, O, K], expert_ids [N] -> [N, O]

For decoding, where a step has a few tokens: a grouped GEMM over the E experts pays for E mostly
empty groups, and the grouped path's permute and combine for a handful of rows; here each row
reads its own expert's [O, K] matrix once. The reference gathers the chosen matrices and runs
one batched matmul (it copies them: about three times the kernel's memory traffic). The Triton
kernel runs one program per (row, block of outputs), looping over K, accumulating in fp32.

Decoding's MoE block runs two fused forms (Qwen3, Mixtral: SwiGLU experts without biases), so
that a token's k experts cost two launches, not six:

    expert_swiglu_gemv   a[t·k + j] = silu(gate) * up of weight[ids[t, j]] @ x[t]     -> [T·k, I]
    expert_gemv_combine  out[t] = Σ_j w[t, j] · weight[ids[t, j]] @ a[t·k + j]      -> [T, H]

(no repeated copies of x, no separate activation, no separate weighted sum). They round where the
unfused path rounds (gate and up, each expert's output) and add up in fp32.

Limits: forward only (inference: no autograd); rows that chose the same expert each read it, so
for many rows the grouped GEMM is faster — the MoE block chooses by the number of rows
(`models/moe.py`, `SELECTED_EXPERT_ROWS`).
"""

import torch

from moemesh.ops.backend import tl, triton, tuned, use_triton


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 3 or expert_ids.shape != x.shape[:1] or weight.shape[2] != x.shape[1]:
        raise ValueError(f"need x [N, K], weight [E, O, K], expert_ids [N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(expert_ids.shape)}")
    if use_triton(x):
        return expert_gemv_triton(x, weight, expert_ids)
    return expert_gemv_reference(x, weight, expert_ids)


# Tiles tried at a shape's first launch (backend.tuned), for each of the two fused kernels.
SWIGLU_CONFIGS = [triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w)
                  for o, k, w in ((16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 4), (4, 1024, 4))]
COMBINE_CONFIGS = [triton.Config({"BLOCK_OUT": o, "BLOCK_K": k}, num_warps=w)  # [top-k, o, k] tiles
                   for o, k, w in ((8, 128, 4), (4, 256, 4), (16, 64, 4), (8, 256, 8), (4, 128, 4))]


def expert_swiglu_gemv(x: torch.Tensor, gate_up: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """x [T, K], gate_up [E, 2I, K] (gate rows, then up rows), expert_ids [T, k] -> [T·k, I]
    (Triton only: the reference is swiglu(expert_gemv(repeated x, gate_up, ids)))."""
    x, gate_up = x.contiguous(), gate_up.contiguous()
    tokens, k = expert_ids.shape
    inner = gate_up.shape[1] // 2
    out = x.new_empty(tokens * k, inner)
    if tokens:
        _expert_swiglu_gemv_kernel[lambda meta: (tokens * k, triton.cdiv(inner, meta["BLOCK_OUT"]))](
            x, gate_up, expert_ids.contiguous(), out, tokens, x.shape[1], inner, K=k)
    return out


def expert_gemv_combine(a: torch.Tensor, down: torch.Tensor, expert_ids: torch.Tensor,
                        weights: torch.Tensor) -> torch.Tensor:
    """a [T·k, I], down [E, H, I], expert_ids and weights [T, k] -> [T, H] (Triton only: the
    reference is combine(expert_gemv(a, down, ids), positions, weights))."""
    a, down = a.contiguous(), down.contiguous()
    tokens, k = expert_ids.shape
    hidden = down.shape[1]
    out = a.new_empty(tokens, hidden)
    if tokens:
        _expert_gemv_combine_kernel[lambda meta: (tokens, triton.cdiv(hidden, meta["BLOCK_OUT"]))](
            a, down, expert_ids.contiguous(), weights.contiguous(), out, tokens, a.shape[1], hidden, K=k,
            K_PAD=triton.next_power_of_2(k))
    return out


def expert_gemv_reference(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    return torch.bmm(weight[expert_ids], x.to(weight.dtype).unsqueeze(-1)).squeeze(-1).to(x.dtype)


def expert_gemv_triton(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    rows, (_, out_features, inner) = x.shape[0], weight.shape
    out = x.new_empty(rows, out_features)
    if rows and out_features:  # a launch grid must not be empty
        block_out = 16
        _expert_gemv_kernel[(rows, triton.cdiv(out_features, block_out))](
            x, weight, expert_ids.contiguous(), out, inner, out_features, BLOCK_OUT=block_out, BLOCK_K=256)
    return out


@triton.jit
def _expert_gemv_kernel(x_ptr, weight_ptr, ids_ptr, out_ptr, inner, out_features,
                        BLOCK_OUT: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    matrix = weight_ptr + expert * out_features * inner  # 64-bit: E·O·K passes 2**31
    acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for start in range(0, inner, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        xs = tl.load(x_ptr + row * inner + ks, mask=ks < inner, other=0.0).to(tl.float32)
        w = tl.load(matrix + cols[:, None].to(tl.int64) * inner + ks[None, :],
                    mask=(cols[:, None] < out_features) & (ks[None, :] < inner), other=0.0).to(tl.float32)
        acc += tl.sum(w * xs[None, :], axis=1)
    tl.store(out_ptr + row * out_features + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < out_features)


@tuned(SWIGLU_CONFIGS, key=["tokens", "hidden", "inner", "K"])
@triton.jit
def _expert_swiglu_gemv_kernel(x_ptr, weight_ptr, ids_ptr, out_ptr, tokens, hidden, inner, K: tl.constexpr,
                               BLOCK_OUT: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # token row // K, its (row % K)-th expert
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    gate_rows = weight_ptr + expert * 2 * inner * hidden + cols[:, None].to(tl.int64) * hidden
    up_rows = gate_rows + inner * hidden
    x_row = x_ptr + (row // K) * hidden
    gate = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    up = tl.zeros([BLOCK_OUT], dtype=tl.float32)
    for start in range(0, hidden, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        xs = tl.load(x_row + ks, mask=ks < hidden, other=0.0).to(tl.float32)[None, :]
        mask = (cols[:, None] < inner) & (ks[None, :] < hidden)
        gate += tl.sum(tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * xs, axis=1)
        up += tl.sum(tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32) * xs, axis=1)
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the unfused GEMV's output
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inner + cols, out.to(out_ptr.dtype.element_ty), mask=cols < inner)


@tuned(COMBINE_CONFIGS, key=["tokens", "inner", "hidden", "K"])
@triton.jit
def _expert_gemv_combine_kernel(a_ptr, weight_ptr, ids_ptr, weights_ptr, out_ptr, tokens, inner, hidden,
                                K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_OUT: tl.constexpr,
                                BLOCK_K: tl.constexpr):
    # The token's K experts at once, a [K, BLOCK_OUT, BLOCK_K] tile of their weights a step: more
    # bytes in flight than one expert after another.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    slots = tl.arange(0, K_PAD)
    rows = token * K + slots
    experts = tl.load(ids_ptr + rows, mask=slots < K, other=0).to(tl.int64)
    matrices = weight_ptr + experts[:, None, None] * hidden * inner + cols[None, :, None].to(tl.int64) * inner
    acc = tl.zeros([K_PAD, BLOCK_OUT], dtype=tl.float32)
    for start in range(0, inner, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        xs = tl.load(a_ptr + rows[:, None] * inner + ks[None, :], mask=(slots[:, None] < K) & (ks[None, :] < inner),
                     other=0.0).to(tl.float32)
        mask = (slots[:, None, None] < K) & (cols[None, :, None] < hidden) & (ks[None, None, :] < inner)
        w = tl.load(matrices + ks[None, None, :], mask=mask, other=0.0)
        acc += tl.sum(w.to(tl.float32) * xs[:, None, :], axis=2)
    expert_out = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the unfused GEMV's output
    weights = tl.load(weights_ptr + rows, mask=slots < K, other=0.0).to(tl.float32)
    total = tl.sum(weights[:, None] * expert_out, axis=0)
    tl.store(out_ptr + token * hidden + cols, total.to(out_ptr.dtype.element_ty), mask=cols < hidden)
