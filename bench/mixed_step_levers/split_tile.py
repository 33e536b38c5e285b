"""Scratch: a loaded round's expert GEMMs as one torch._grouped_mm (its tile picked by the mean
rows a group: <= 128 -> 64x128x128 pingpong, else 128x256x64 cooperative), padded to the large
tile, or split in two launches: experts of more than T rows on the large tile (x padded past
E*128 rows, rows past the last offset not computed), the rest on the small one.
Timed as CUDA graphs (20 replays), gate_up + swiglu + down, and the GEMMs alone."""

import torch

from moemesh.ops.grouped_mm import _grouped_mm_kernel
from moemesh.ops.swiglu import swiglu

E, H, I = 128, 2048, 768  # noqa: E741
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
gate_up = torch.randn(E, 2 * I, H, device=dev, dtype=dt) * 0.02
down = torch.randn(E, H, I, device=dev, dtype=dt) * 0.02
BIG = E * 129


def sizes_for(case, g):
    sizes = torch.zeros(E, dtype=torch.long)
    perm = torch.randperm(E, generator=g)
    kind, n = case.split()
    n = int(n)
    if kind == "random":  # n prompts of 512 (8 experts take ~480 rows each) + 60 decode tokens
        sizes[perm[: 8 * n]] += 480
        sizes[perm[8 * n : 25 * n]] += 15
        sizes[torch.randperm(E, generator=g)[:65]] += 7
    elif kind == "spread":
        sizes += 32 * n
        sizes[torch.randperm(E, generator=g)[:65]] += 7
    elif kind == "decode":
        sizes[torch.randperm(E, generator=g)[:65]] += 7 * n
    else:
        sizes += n * 8 // E
    return sizes


def graph_us(fn, replays=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(replays):
            fn()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / replays)
    return sorted(times)[3]


def run_case(case, g):
    sizes = sizes_for(case, g)
    n = int(sizes.sum())
    x = torch.randn(max(n, BIG), H, device=dev, dtype=dt)
    row = {"case": case, "pairs": n, "mean": round(n / E)}

    def one(offs_list):
        """[(rows of the buffer, offsets)] launches; returns (full fn, gemm-only fn)."""
        bufs = [(x[:t], offs, torch.randn(t, I, device=dev, dtype=dt)) for t, offs in offs_list]

        def full():
            return [
                _grouped_mm_kernel(
                    swiglu(_grouped_mm_kernel(xb, gate_up.transpose(-2, -1), offs=o)), down.transpose(-2, -1), offs=o
                )
                for xb, o, _ in bufs
            ]

        def gemms():
            for xb, o, ab in bufs:
                _grouped_mm_kernel(xb, gate_up.transpose(-2, -1), offs=o)
                _grouped_mm_kernel(ab, down.transpose(-2, -1), offs=o)

        return full, gemms

    offs = torch.cumsum(sizes, 0).to(dev, torch.int32)
    variants = {"natural": [(n, offs)], "large": [(max(n, BIG), offs)]}
    for T in (16, 32, 64, 128, 256):
        heavy = sizes > T
        if heavy.all() or not heavy.any():
            continue
        # same x rows for both launches here: the timing depends on sizes, not values
        variants[f"split{T}"] = [
            (BIG, torch.cumsum(sizes * heavy, 0).to(dev, torch.int32)),
            (n, torch.cumsum(sizes * ~heavy, 0).to(dev, torch.int32)),
        ]
    for name, spec in variants.items():
        full, gemms = one(spec)
        row[name] = f"{graph_us(full):.0f}/{graph_us(gemms):.0f}"
    return row


g = torch.Generator().manual_seed(1)
rows = [
    run_case(c, g)
    for c in (
        "decode 1",
        "random 1",
        "random 2",
        "random 3",
        "random 4",
        "spread 1",
        "spread 3",
        "uniform 1024",
        "uniform 2048",
    )
]
cols = list(dict.fromkeys(k for r in rows for k in r))
print("µs a layer, gate_up+swiglu+down / GEMMs alone")
print("| " + " | ".join(cols) + " |")
for r in rows:
    print("| " + " | ".join(str(r.get(k, "")) for k in cols) + " |")
