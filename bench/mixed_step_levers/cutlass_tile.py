"""Scratch: torch._grouped_mm picks its CUTLASS tile by the mean rows a group (<= 128: 64x128x128
pingpong, else 128x256x64 cooperative). Rows past offs[-1] are not computed, so padding x's rows
picks the large tile. Which is faster for a loaded round's group sizes?"""

import torch

from bench.common import median_ms
from moemesh.ops.grouped_mm import _grouped_mm_kernel
from moemesh.ops.swiglu import swiglu

E, H, I = 128, 2048, 768  # noqa: E741 (the shape's names)
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=dt) * 0.02


def sizes_for(case, g):
    sizes = torch.zeros(E, dtype=torch.long)
    perm = torch.randperm(E, generator=g)
    kind, n = case.split()
    n = int(n)
    if kind == "random":
        sizes[perm[: 8 * n]] += 480
        sizes[perm[8 * n : 25 * n]] += 15
        sizes[torch.randperm(E, generator=g)[:65]] += 7
    elif kind == "spread":
        sizes += 32 * n
        sizes[torch.randperm(E, generator=g)[:65]] += 7
    elif kind == "decode":
        sizes[torch.randperm(E, generator=g)[:65]] += 7 * n
    else:  # uniform prefill of n tokens, top-8
        sizes += n * 8 // E
    return sizes


rows = []
g = torch.Generator().manual_seed(1)
for case in (
    "decode 1",
    "random 1",
    "random 2",
    "random 3",
    "random 4",
    "spread 1",
    "spread 4",
    "uniform 1024",
    "uniform 2048",
    "uniform 4096",
    "uniform 8192",
):
    sizes = sizes_for(case, g)
    n = int(sizes.sum())
    offs = torch.cumsum(sizes, 0).to(dev, torch.int32)
    out = {}
    for pad in (0, 1):
        total = max(n, E * 129) if pad else n
        x = torch.randn(total, H, device=dev, dtype=dt)
        a_buf = torch.randn(total, I, device=dev, dtype=dt)

        def run():
            a = swiglu(_grouped_mm_kernel(x, gate_up.transpose(-2, -1), offs=offs))
            return _grouped_mm_kernel(a, down.transpose(-2, -1), offs=offs)

        def gu():
            return _grouped_mm_kernel(x, gate_up.transpose(-2, -1), offs=offs)

        def dn():
            return _grouped_mm_kernel(a_buf, down.transpose(-2, -1), offs=offs)

        res = run()[:n].float()
        out[pad] = (median_ms(gu, 3, 15) * 1e3, median_ms(dn, 3, 15) * 1e3, res)
    err = ((out[0][2] - out[1][2]).norm() / out[0][2].norm()).item()
    mean = n / E
    rows.append(
        dict(
            case=case,
            pairs=n,
            mean_rows=f"{mean:.0f}",
            natural=("small" if mean <= 128 else "large"),
            gate_up_natural=f"{out[0][0]:.0f}",
            gate_up_large=f"{out[1][0]:.0f}",
            down_natural=f"{out[0][1]:.0f}",
            down_large=f"{out[1][1]:.0f}",
            rel_diff=f"{err:.1e}",
        )
    )
keys = list(rows[0])
print("| " + " | ".join(keys) + " |")
for r in rows:
    print("| " + " | ".join(str(r[k]) for k in keys) + " |")
