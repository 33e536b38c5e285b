"""Expert GEMV: each row times the weight of the expert it chose, reading only chosen weights.

    out[i] = weight[expert_ids[i]] @ x[i]        x [N, K], weight [E, O, K], expert_ids [N] -> [N, O]

For decoding, where a step has a few tokens: a grouped GEMM over the E experts pays for E mostly
empty groups, and the grouped path's permute and combine for a handful of rows; here each row
reads its own expert's [O, K] matrix once. The reference gathers the chosen matrices and runs
one batched matmul (it copies them: about three times the kernel's memory traffic). The Triton
kernel runs one program per (row, block of outputs), looping over K, accumulating in fp32.

Limits: forward only (inference: no autograd); rows that chose the same expert each read it, so
for many rows the grouped GEMM is faster — the MoE block chooses by the number of rows
(`models/moe.py`, `SELECTED_EXPERT_ROWS`).
"""

import torch

from moemesh.ops.backend import tl, triton, use_triton


def expert_gemv(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 3 or expert_ids.shape != x.shape[:1] or weight.shape[2] != x.shape[1]:
        raise ValueError(f"need x [N, K], weight [E, O, K], expert_ids [N]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(expert_ids.shape)}")
    if use_triton(x):
        return expert_gemv_triton(x, weight, expert_ids)
    return expert_gemv_reference(x, weight, expert_ids)


def expert_gemv_reference(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    return torch.bmm(weight[expert_ids], x.to(weight.dtype).unsqueeze(-1)).squeeze(-1).to(x.dtype)


def expert_gemv_triton(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor,
                       block_out: int = 16, block_k: int = 256) -> torch.Tensor:
    x, weight = x.contiguous(), weight.contiguous()
    rows, (_, out_features, inner) = x.shape[0], weight.shape
    out = x.new_empty(rows, out_features)
    if rows and out_features:  # a launch grid must not be empty
        _expert_gemv_kernel[(rows, triton.cdiv(out_features, block_out))](
            x, weight, expert_ids.contiguous(), out, inner, out_features, BLOCK_OUT=block_out, BLOCK_K=block_k)
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
