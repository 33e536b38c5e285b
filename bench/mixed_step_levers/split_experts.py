"""Scratch: does a mixed step's MoE gain from the light experts (<= T rows) on the per-expert GEMV
and only the heavy ones on the grouped GEMM?  Synthetic group sizes like a loaded round's."""

import torch

from bench.common import median_ms
from moemesh.ops.expert_gemv import expert_gemv
from moemesh.ops.grouped_mm import _grouped_mm_kernel
from moemesh.ops.swiglu import swiglu

E, H, I = 128, 2048, 768  # noqa: E741 (the shape's names)
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=dt) * 0.02


def sizes_for(case: str, g: torch.Generator) -> torch.Tensor:
    sizes = torch.zeros(E, dtype=torch.long)
    perm = torch.randperm(E, generator=g)
    if case.startswith("random"):
        prompts = int(case.split()[1])
        heavy = perm[: 8 * prompts]
        sizes[heavy] += 480
        mid = perm[8 * prompts : 8 * prompts + 17 * prompts]
        sizes[mid] += 15
    else:  # spread: every expert
        prompts = int(case.split()[1])
        sizes += 32 * prompts
    decode = torch.randperm(E, generator=g)[:65]
    sizes[decode] += 7
    return sizes


def timed(fn):
    return median_ms(fn, warmup=3, repeat=15) * 1e3


def main():
    rows = []
    g = torch.Generator().manual_seed(1)
    for case in ("random 1", "random 3", "random 4", "spread 1"):
        sizes = sizes_for(case, g)
        n = int(sizes.sum())
        x = torch.randn(n, H, device=dev, dtype=dt)
        ids_all = torch.repeat_interleave(torch.arange(E), sizes).to(dev)
        offs = torch.cumsum(sizes, 0).to(dev, torch.int32)

        def grouped_all():
            a = swiglu(_grouped_mm_kernel(x, gate_up.transpose(-2, -1), offs=offs))
            return _grouped_mm_kernel(a, down.transpose(-2, -1), offs=offs)

        base = timed(grouped_all)
        reference = grouped_all()
        for light_max in (8, 16, 32):
            light = (sizes <= light_max).to(dev)
            # heavy experts' rows first (by expert), then the light ones' (by expert)
            key = ids_all + E * light[ids_all].long()
            order = torch.argsort(key, stable=True)
            xs = x[order]
            heavy_sizes = torch.where(light, 0, sizes.to(dev))
            offs_h = torch.cumsum(heavy_sizes, 0).to(torch.int32)
            ids_sorted = ids_all[order]
            light_ids = torch.where(light[ids_sorted], ids_sorted, -1).view(-1, 1)

            def split():
                a = swiglu(_grouped_mm_kernel(xs, gate_up.transpose(-2, -1), offs=offs_h))
                a_l = expert_gemv(xs, gate_up, light_ids, glu=True)
                a = torch.where(light_ids >= 0, a_l, a)
                o = _grouped_mm_kernel(a, down.transpose(-2, -1), offs=offs_h)
                o_l = expert_gemv(a, down, light_ids)
                return torch.where(light_ids >= 0, o_l, o)

            def heavy_only():
                a = swiglu(_grouped_mm_kernel(xs, gate_up.transpose(-2, -1), offs=offs_h))
                return _grouped_mm_kernel(a, down.transpose(-2, -1), offs=offs_h)

            def light_only():
                a_l = expert_gemv(xs, gate_up, light_ids, glu=True)
                return expert_gemv(a_l, down, light_ids)

            got = split()
            err = ((got.float() - reference[order].float()).norm() / reference.float().norm()).item()
            rows.append(
                dict(
                    case=case,
                    pairs=n,
                    experts=int((sizes > 0).sum()),
                    light_max=light_max,
                    light_experts=int(((sizes > 0) & (sizes <= light_max)).sum()),
                    light_rows=int(sizes[sizes <= light_max].sum()),
                    grouped_all_us=f"{base:.0f}",
                    split_us=f"{timed(split):.0f}",
                    heavy_grouped_us=f"{timed(heavy_only):.0f}",
                    light_gemv_us=f"{timed(light_only):.0f}",
                    rel_err=f"{err:.1e}",
                )
            )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")


main()
