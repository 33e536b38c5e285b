"""A Triton grouped GEMM for inference's prefill rounds against `torch._grouped_mm`, at the
shapes of the 48-layer Qwen3-30B-A3B shape's MoE (128 experts, gate_up [2048 -> 1536], down
[768 -> 2048]), rows spread over the experts evenly or skewed, over a sweep of tiles.

    PYTHONPATH=. python3 bench/grouped_gemm_sweep.py            # one GPU
    PYTHONPATH=. python3 bench/grouped_gemm_sweep.py --smoke    # CPU, TRITON_INTERPRET=1: correctness only

Prints µs a call and the weights' read rate, and the error against an fp32 reference.
"""

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench.common import print_table  # noqa: E402


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    ends_ptr,  # [E] int32: end row of each group (cumulative sizes)
    tile_ends_ptr,  # [E] int32: cumulative count of row tiles per group
    N,
    K,
    E,
    LOG_E: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    N_FASTEST: tl.constexpr,
):
    if N_FASTEST:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    total = tl.load(tile_ends_ptr + E - 1)
    if pid_m >= total:
        return
    # The group of this row tile: the first e with tile_ends[e] > pid_m (binary search).
    lo = 0
    hi = E
    for _ in tl.static_range(LOG_E):
        mid = (lo + hi) // 2
        below = tl.load(tile_ends_ptr + mid) <= pid_m
        lo = tl.where(below, mid + 1, lo)
        hi = tl.where(below, hi, mid)
    e = lo
    first_tile = tl.where(e > 0, tl.load(tile_ends_ptr + e - 1, mask=e > 0, other=0), 0)
    start = tl.where(e > 0, tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 0)
    end = tl.load(ends_ptr + e)
    rows = start + (pid_m - first_tile) * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    a_ptrs = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * N * K + cols[None, :].to(tl.int64) * K + ks[:, None]
    row_ok = rows[:, None] < end
    col_ok = cols[None, :] < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptrs, mask=row_ok & (ks[None, :] + k < K), other=0.0)
        b = tl.load(b_ptrs, mask=col_ok & (ks[:, None] + k < K), other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=row_ok & col_ok
    )


def triton_grouped_mm(x, weight, ends, bm=128, bn=128, bk=64, warps=8, stages=3, n_fastest=True):
    """x [M, K] rows sorted by group, weight [E, N, K], ends [E] int32 -> [M, N]."""
    experts, n, k = weight.shape
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    tile_ends = torch.cumsum((sizes + bm - 1) // bm, 0, dtype=torch.int32)
    out = x.new_empty(x.shape[0], n)
    max_tiles = triton.cdiv(x.shape[0], bm) + experts
    grid = (triton.cdiv(n, bn), max_tiles) if n_fastest else (max_tiles, triton.cdiv(n, bn))
    _grouped_gemm_kernel[grid](
        x,
        weight,
        out,
        ends,
        tile_ends,
        n,
        k,
        experts,
        max(1, (experts - 1).bit_length() + 1),
        BM=bm,
        BN=bn,
        BK=bk,
        N_FASTEST=n_fastest,
        num_warps=warps,
        num_stages=stages,
    )
    return out


def sizes_for(rows_per_expert: int, experts: int, skew: bool, gen) -> torch.Tensor:
    total = rows_per_expert * experts
    if not skew:
        return torch.full((experts,), rows_per_expert, dtype=torch.int32)
    share = torch.distributions.Dirichlet(torch.full((experts,), 1.0)).sample()
    sizes = (share * total).floor().to(torch.int32)
    sizes[0] += total - int(sizes.sum())
    return sizes


def main():
    device = "cpu" if SMOKE else "cuda"
    dtype = torch.float32 if SMOKE else torch.bfloat16
    experts, hidden, inner = (8, 64, 48) if SMOKE else (128, 2048, 768)
    rows_list = (3, 20) if SMOKE else (8, 16, 32, 64, 128, 256)
    gen = torch.manual_seed(0)
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    configs = (
        [(64, 32, 32, 4, 2)]
        if SMOKE
        else [
            (bm, bn, bk, w, s)
            for bm, bn, bk, w, s in (
                (64, 128, 64, 4, 4),
                (64, 128, 128, 4, 3),
                (64, 256, 64, 8, 3),
                (128, 128, 64, 8, 3),
                (128, 128, 64, 8, 4),
                (128, 128, 128, 8, 3),
                (128, 256, 64, 8, 3),
                (64, 64, 128, 4, 4),
            )
        ]
    )
    rows = []
    for name, n, k in (("gate_up", 2 * inner, hidden), ("down", hidden, inner)):
        weight = torch.randn(experts, n, k, device=device, dtype=dtype) * 0.02
        for per in rows_list:
            for skew in (False, True):
                sizes = sizes_for(per, experts, skew, gen)
                ends = torch.cumsum(sizes, 0, dtype=torch.int32).to(device)
                x = torch.randn(int(sizes.sum()), k, device=device, dtype=dtype)
                want = torch.cat([p.double() @ w.double().T for p, w in zip(torch.split(x, sizes.tolist()), weight)])
                row = {"matrix": name, "rows an expert": f"{per}{' skewed' if skew else ''}"}
                if not SMOKE:
                    ms = triton.testing.do_bench(lambda: grouped(x, weight.transpose(-2, -1), offs=ends))
                    row["torch µs"] = f"{ms * 1e3:.0f}"
                    row["torch TB/s"] = f"{weight.numel() * 2 / ms / 1e9:.2f}"
                best = None
                for config in configs:
                    for n_fastest in (True, False):
                        bm, bn, bk, w, s = config
                        got = triton_grouped_mm(x, weight, ends, bm, bn, bk, w, s, n_fastest)
                        err = ((got.double() - want).norm() / want.norm()).item()
                        assert err < (1e-5 if SMOKE else 1e-2), (config, err)
                        if SMOKE:
                            continue
                        ms = triton.testing.do_bench(
                            lambda: triton_grouped_mm(x, weight, ends, bm, bn, bk, w, s, n_fastest)
                        )
                        if best is None or ms < best[0]:
                            best = (ms, config, n_fastest, err)
                if best:
                    ms, config, n_fastest, err = best
                    row["triton µs"] = f"{ms * 1e3:.0f}"
                    row["triton TB/s"] = f"{weight.numel() * 2 / ms / 1e9:.2f}"
                    row["best tile (BM, BN, BK, warps, stages), n fastest"] = f"{config}, {n_fastest}"
                    row["rel err"] = f"{err:.1e}"
                rows.append(row)
    print_table(rows, "grouped GEMM: torch._grouped_mm against the Triton kernel (best tile)")


if __name__ == "__main__":
    main()
