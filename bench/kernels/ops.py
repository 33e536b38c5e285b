"""Benchmark moemesh's Triton kernels against plain PyTorch, side by side, on one GPU.

    PYTHONPATH=. python3 bench/kernels/ops.py            # H100/H200, bf16, well under 3 minutes
    PYTHONPATH=. python3 bench/kernels/ops.py --smoke    # tiny sizes on CPU under TRITON_INTERPRET=1:
                                                         # checks the script runs; timings meaningless
    PYTHONPATH=. python3 bench/kernels/ops.py --invariant-tiles   # only: batch-invariant matmul tiles
    PYTHONPATH=. python3 bench/kernels/ops.py --invariant-tiles --picked-tiles   # only the picked ones
    PYTHONPATH=. python3 bench/kernels/ops.py --expert-tiles      # only: decoding's per-expert kernel's tiles
    PYTHONPATH=. python3 bench/kernels/ops.py --launches          # only: what a launch costs the host
    PYTHONPATH=. python3 bench/kernels/ops.py --invariant-attention   # only: batch-invariant attention's tiles
    PYTHONPATH=. python3 bench/kernels/ops.py --gemv-tiles        # only: decoding's projections (ops/gemv.py)
    PYTHONPATH=. python3 bench/kernels/ops.py --selected-tiles    # only: batch-invariant decode's experts
    PYTHONPATH=. python3 bench/kernels/ops.py --dequantize-tiles  # only: a quantized bank's dequantization,
                                                                  # its product by the fused kernel, and
                                                                  # whether it hides behind a GEMM
    PYTHONPATH=. python3 bench/kernels/ops.py --quantized-gemv    # only: decoding's kernels on FP8/MXFP4 weights
    PYTHONPATH=. python3 bench/kernels/ops.py --grid-barrier      # only: a dependent launch against a grid barrier

Prints: effective bandwidth of permute / combine / swiglu (forward and backward) as a fraction of
a measured device copy, against the plain PyTorch index path; expert_gemv (decoding's MoE path,
reading only the chosen experts) against its gather + bmm reference and the grouped GEMM over all
experts, at 1, 4, 16 and 64 tokens; linear_cross_entropy against
F.cross_entropy on full fp32 logits (time and peak memory); bf16-vs-fp32-reference errors for every
op, including one problem whose N*H passes 2**31. Times are medians of triton.testing.do_bench.
Writes nothing, except, when $OUT is set, the printed report to $OUT/kernels.txt (Triton's compile
cache goes to a folder under $OUT, removed at exit), and with --record the headline table's times to
the results file (bench/harness.py's `record`).
"""

import argparse
import functools
import os
import shutil
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:  # must precede the first import of moemesh.ops: triton.jit reads it then
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["MOEMESH_KERNELS"] = "triton"
OUT = os.environ.get("OUT")
CACHE_DIR = None
if OUT and "TRITON_CACHE_DIR" not in os.environ:
    CACHE_DIR = os.path.join(OUT, "triton-cache")
    os.environ["TRITON_CACHE_DIR"] = CACHE_DIR

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.harness import add_record_flag, describe_device, record, rel_err  # noqa: E402
from moemesh.ops import combine, linear_cross_entropy, permute, swiglu  # noqa: E402
from moemesh.ops.backend import dependent_launch, tl, triton, wait_for_inputs  # noqa: E402
from moemesh.ops.combine import _Combine, combine_reference  # noqa: E402
from moemesh.ops.expert_gemv import expert_gemv_reference, expert_gemv_triton  # noqa: E402
from moemesh.ops.grouped_mm import grouped_mm  # noqa: E402
from moemesh.ops.linear_cross_entropy import linear_cross_entropy_reference  # noqa: E402
from moemesh.ops.permute import (  # noqa: E402
    _PermuteRows,
    permute_rows_reference,
    routing_layout,  # noqa: E402
)
from moemesh.ops.swiglu import _SwiGLU, swiglu_reference  # noqa: E402

DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.bfloat16
# Qwen3-30B-A3B-like MoE layer and Qwen vocabulary; the smoke sizes only exercise the code.
SIZES = dict(tokens=16384, k=8, hidden=2048, experts=128, inner=768, vocab=151936, copy_bytes=2**30)
if SMOKE:
    SIZES = dict(tokens=64, k=2, hidden=130, experts=8, inner=40, vocab=500, copy_bytes=2**20)
BF16_TOLERANCE = 1e-2  # bf16 keeps 8 mantissa bits: ~4e-3 relative per rounding, a few roundings
LINES = []
FIGURES = []  # the headline table's figures, for --record: (figure, at, value, unit, peer, peer_value)


def report(line=""):
    print(line, flush=True)
    LINES.append(line)


def sync():
    if not SMOKE:
        torch.cuda.synchronize()


def bench_ms(fn, grad_to_none=None, rep=100):
    """Median milliseconds per call, over about `rep` ms of calls."""
    if SMOKE:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def peak_mib(fn):
    """Peak memory allocated while `fn` runs, beyond what was allocated before (MiB)."""
    if SMOKE:
        fn()
        return float("nan")
    sync()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def backward(out, inputs, grad):
    """A function that runs the backward of an already-built graph (repeatable)."""
    return lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)


def routing(tokens, experts, k):
    topk_ids = torch.rand(tokens, experts, device=DEVICE).topk(k, dim=1).indices
    weights = torch.softmax(torch.randn(tokens, k, device=DEVICE), dim=1)  # fp32 router weights
    return topk_ids, weights


def copy_bandwidth():
    """GB/s of a large device-to-device copy (bytes read + written)."""
    src = torch.empty(SIZES["copy_bytes"] // 2, dtype=DTYPE, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * SIZES["copy_bytes"] / bench_ms(lambda: dst.copy_(src)) / 1e6


def bandwidth_rows(copy_gbps):
    """permute / combine / swiglu, forward and backward: moemesh vs the plain PyTorch index path."""
    tokens, k, hidden, experts, inner = (SIZES[n] for n in ("tokens", "k", "hidden", "experts", "inner"))
    e = torch.finfo(DTYPE).bits // 8
    x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    topk_ids, weights = routing(tokens, experts, k)
    weights.requires_grad_()
    position, _, _, _ = routing_layout(x, topk_ids, experts, align=1)
    n = topk_ids.numel()  # align 1 leaves no padding rows
    grouped = torch.randn(n, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    gate_up = torch.randn(n, 2 * inner, dtype=DTYPE, device=DEVICE, requires_grad=True)

    # The plain PyTorch path (as in transformers' MoE blocks) indexes per grouped row: its token
    # and its routing weight, gathers with x[idx] and sums with index_add; autograd does the rest.
    row_token = torch.empty(n, dtype=torch.long, device=DEVICE)
    row_token[position.reshape(-1)] = torch.arange(tokens, device=DEVICE).repeat_interleave(k)
    no_weight = torch.empty(n, dtype=weights.dtype, device=DEVICE)

    def torch_combine(grouped, weights):
        row_weight = no_weight.index_put((position.reshape(-1),), weights.reshape(-1)).to(DTYPE)
        out = torch.zeros(tokens, hidden, dtype=DTYPE, device=DEVICE)
        return out.index_add(0, row_token, grouped * row_weight[:, None])

    def torch_swiglu(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    index = tokens * k * 8  # bytes of `position`; the fp32 routing weights are half that
    ops = [  # name, inputs, output grad, moemesh, torch, fwd bytes, bwd bytes (minimal read+write)
        ("permute", (x,), torch.randn_like(grouped),
         lambda x: _PermuteRows.apply(x, position, n, True), lambda x: x[row_token],
         (tokens + n) * hidden * e + index, (n + tokens) * hidden * e + index),
        # bwd: grad_out read once, grouped read for the weight gradient, grad of grouped written
        ("combine", (grouped, weights), torch.randn_like(x),
         lambda g, w: _Combine.apply(g, position, w, False), torch_combine,
         (n + tokens) * hidden * e + index * 3 // 2, (tokens + 2 * n) * hidden * e + index * 2),
        ("swiglu", (gate_up,), torch.randn(n, inner, dtype=DTYPE, device=DEVICE),
         _SwiGLU.apply, torch_swiglu, n * 3 * inner * e, n * 5 * inner * e),
    ]  # fmt: skip

    report(f"T={tokens} k={k} H={hidden} E={experts} I={inner} {str(DTYPE)[6:]}, fp32 router weights, align 1")
    report("effective GB/s = minimal bytes read+written / time (the same count for both columns);")
    report("peak MiB = memory allocated during one fwd+bwd beyond its inputs")
    header = f"{'ms':>9}{'GB/s':>7}{'%copy':>7}{'MiB':>7}"
    report(f"{'':<13}{'moemesh':^30}{'torch index path':^30}")
    report(f"{'op':<13}{header}{header}{'speedup':>9}")
    for name, inputs, grad, ours, plain, fwd_bytes, bwd_bytes in ops:
        cells = {"fwd": [], "bwd": []}
        for impl in (ours, plain):
            graph = impl(*inputs)
            timings = {"fwd": bench_ms(lambda: impl(*inputs)), "bwd": bench_ms(backward(graph, inputs, grad))}
            del graph
            peak = peak_mib(lambda: torch.autograd.grad(impl(*inputs), inputs, grad))
            for phase, nbytes in (("fwd", fwd_bytes), ("bwd", bwd_bytes)):
                ms, gbps = timings[phase], nbytes / timings[phase] / 1e6
                cells[phase].append((ms, f"{ms:>9.3f}{gbps:>7.0f}{gbps / copy_gbps:>7.0%}{peak:>7.0f}"))
        for phase, ((ours_ms, ours_cell), (plain_ms, plain_cell)) in cells.items():
            report(f"{name + ' ' + phase:<13}{ours_cell}{plain_cell}{plain_ms / ours_ms:>8.2f}x")
            at = {"op": name, "pass": phase, "tokens": tokens}
            FIGURES.append(("kernel ms", at, ours_ms, "ms", "torch index path", plain_ms))
    index_ms = bench_ms(lambda: routing_layout(x, topk_ids, experts, 1))
    report(f"permute's index math (torch: sort, searchsorted, one host sync): {index_ms:.3f} ms")


def expert_gemv_rows(copy_gbps):
    """Decoding's tokens through the gate_up bank [E, 2I, H]: expert_gemv (Triton, per expert),
    its gather + bmm reference, and the grouped GEMM over all E groups (the training path). GB/s
    counts the distinct chosen experts' weights, read once."""
    k, hidden, experts, inner = (SIZES[n] for n in ("k", "hidden", "experts", "inner"))
    e = torch.finfo(DTYPE).bits // 8
    weight = torch.randn(experts, 2 * inner, hidden, dtype=DTYPE, device=DEVICE)
    report(f"expert_gemv: gate_up [E={experts}, 2I={2 * inner}, H={hidden}] {str(DTYPE)[6:]}, top-{k}")
    report(
        f"{'tokens':>6}{'experts':>8}{'gemv ms':>9}{'GB/s':>7}{'%copy':>7}{'gather+bmm':>11}{'grouped_mm':>11}"
        f"{'err':>9}"
    )
    for tokens in (1, 4, 16, 64):
        x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE)
        ids = torch.stack([torch.randperm(experts, device=DEVICE)[:k] for _ in range(tokens)])
        order = ids.flatten().argsort()
        sizes = torch.bincount(ids.flatten(), minlength=experts)
        nbytes = int(ids.unique().numel()) * 2 * inner * hidden * e
        gemv = bench_ms(lambda: expert_gemv_triton(x, weight, ids))
        gather = bench_ms(lambda: expert_gemv_reference(x, weight, ids))
        grouped = bench_ms(lambda: grouped_mm(x.repeat_interleave(k, 0)[order], weight, sizes))
        err = rel_err(expert_gemv_triton(x, weight, ids), expert_gemv_reference(x.float(), weight.float(), ids))
        gbps = nbytes / gemv / 1e6
        report(
            f"{tokens:>6}{int(ids.unique().numel()):>8}{gemv:>9.3f}{gbps:>7.0f}{gbps / copy_gbps:>7.0%}"
            f"{gather:>11.3f}{grouped:>11.3f}{err:>9.1e}"
        )
        FIGURES.append(("kernel ms", {"op": "expert_gemv", "tokens": tokens}, gemv, "ms", "gather+bmm", gather))


def linear_cross_entropy_rows():
    tokens, hidden, vocab = SIZES["tokens"], SIZES["hidden"], SIZES["vocab"]
    hidden_states = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * hidden**-0.5).to(DTYPE).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)

    def ours():
        linear_cross_entropy(hidden_states, weight, labels).backward()

    def plain():
        F.cross_entropy((hidden_states @ weight.T).float(), labels).backward()

    report(f"linear_cross_entropy, fwd+bwd: T={tokens} H={hidden} V={vocab} {str(DTYPE)[6:]}")
    report(f"{'':<28}{'ms':>9}{'peak GiB':>10}")
    results = {}
    for name, fn in (("moemesh linear_cross_entropy", ours), ("F.cross_entropy(fp32 logits)", plain)):
        ms = bench_ms(fn, grad_to_none=[hidden_states, weight], rep=600)  # ~50 ms a call
        hidden_states.grad = weight.grad = None
        gib = peak_mib(fn) / 1024
        hidden_states.grad = weight.grad = None
        results[name] = (ms, gib)
        report(f"{name:<28}{ms:>9.2f}{gib:>10.2f}")
    (ours_ms, ours_gib), (plain_ms, plain_gib) = results.values()
    report(f"{'ratio torch / moemesh':<28}{plain_ms / ours_ms:>8.2f}x{plain_gib / ours_gib:>9.2f}x")
    at, peer = {"op": "linear_cross_entropy", "pass": "fwd+bwd", "tokens": tokens}, "F.cross_entropy fp32 logits"
    FIGURES.append(("kernel ms", at, ours_ms, "ms", peer, plain_ms))
    if not SMOKE:  # no peak memory on a CPU
        FIGURES.append(("kernel peak memory GiB", at, ours_gib, "GiB", peer, plain_gib))


def correctness_rows():
    """bf16 kernels vs the op's reference run in fp32 on the same (upcast) inputs."""
    tokens, k, hidden, experts, inner, vocab = (
        SIZES[n] for n in ("tokens", "k", "hidden", "experts", "inner", "vocab")
    )
    results = []

    def check(op, quantity, got, want):
        results.append((op, quantity, rel_err(got, want)))

    def fp32_copy(t):
        return t.detach().float().requires_grad_(t.requires_grad)

    x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    topk_ids, weights = routing(tokens, experts, k)
    weights.requires_grad_()
    layout = permute(x, topk_ids, experts, align=16)
    x32 = fp32_copy(x)
    want = permute_rows_reference(x32, layout.position, layout.host_offsets[-1])
    check("permute", "out", layout.grouped, want)
    grad = torch.randn_like(want)
    got_grad, want_grad = torch.autograd.grad(layout.grouped, x, grad.to(DTYPE)), torch.autograd.grad(want, x32, grad)
    check("permute", "grad x", got_grad[0], want_grad[0])

    grouped = torch.randn(layout.host_offsets[-1], hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    g32, w32 = fp32_copy(grouped), fp32_copy(weights)
    out, want = combine(grouped, layout.position, weights), combine_reference(g32, layout.position, w32)
    check("combine", "out", out, want)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, (grouped, weights), grad.to(DTYPE))
    want_grads = torch.autograd.grad(want, (g32, w32), grad)
    check("combine", "grad grouped", got_grads[0], want_grads[0])
    check("combine", "grad weights", got_grads[1], want_grads[1])

    gate_up = torch.randn(tokens * k, 2 * inner, dtype=DTYPE, device=DEVICE, requires_grad=True)
    gu32 = fp32_copy(gate_up)
    out, want = swiglu(gate_up), swiglu_reference(gu32)
    check("swiglu", "out", out, want)
    grad = torch.randn_like(want)
    got_grad, want_grad = torch.autograd.grad(out, gate_up, grad.to(DTYPE)), torch.autograd.grad(want, gu32, grad)
    check("swiglu", "grad", got_grad[0], want_grad[0])

    h = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=DEVICE) * hidden**-0.5).to(DTYPE).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=DEVICE)
    labels[::7] = -100
    h32, w32 = fp32_copy(h), fp32_copy(w)
    loss = linear_cross_entropy(h, w, labels, z_loss=1e-4)
    want = linear_cross_entropy_reference(h32, w32, labels, z_loss=1e-4)
    check("linear_cross_entropy", "loss", loss, want)
    got_grads, want_grads = torch.autograd.grad(loss, (h, w)), torch.autograd.grad(want, (h32, w32))
    check("linear_cross_entropy", "grad hidden", got_grads[0], want_grads[0])
    check("linear_cross_entropy", "grad weight", got_grads[1], want_grads[1])
    del h32, w32, want, want_grads, got_grads

    # On the GPU at full size; in the smoke run a tiny one, only to run the code.
    results += int64_index_checks(8, 2048, 2**31) if not SMOKE else int64_index_checks(k, hidden, 2**14)
    report(f"bf16 vs fp32 reference, relative error ||out - ref|| / ||ref||, tolerance {BF16_TOLERANCE:g}")
    for op, quantity, err in results:
        verdict = "ok" if err <= BF16_TOLERANCE else "FAIL"
        report(f"{op:<22}{quantity:<34}{err:>10.2e}  {verdict}")
    return all(err <= BF16_TOLERANCE for _, _, err in results)


def int64_index_checks(k, hidden, min_elements):
    """N * H passes `min_elements` (2**31 on the GPU); the last tokens' rows are where 32-bit
    offsets would wrap."""
    last = 64
    tokens = min_elements // (k * hidden) + last
    x = torch.randn(tokens, hidden, dtype=DTYPE, device=DEVICE, requires_grad=True)
    topk_ids, weights = routing(tokens, 16, k)
    layout = permute(x, topk_ids, 16)
    rows = layout.position[-last:].reshape(-1)  # the last tokens' copies, (token, slot) order
    x_last = x.detach()[-last:].float()
    size = f"N*H = {layout.host_offsets[-1] * hidden / 2**31:.3g} * 2^31"
    copies = x_last.repeat_interleave(k, dim=0)
    results = [("permute", f"out, last tokens, {size}", rel_err(layout.grouped[rows], copies))]
    grad_x = torch.autograd.grad(layout.grouped, x, layout.grouped.detach())[0]  # = k * x
    results.append(("permute", "grad x, last tokens", rel_err(grad_x[-last:], k * x_last)))
    del grad_x
    out = combine(layout.grouped, layout.position, weights)  # weights sum to 1: out = x
    results.append(("combine", "out, last tokens", rel_err(out[-last:], x_last)))
    grad_grouped = torch.autograd.grad(out, layout.grouped, torch.ones_like(out))[0]  # rows: weights
    want = weights[-last:].reshape(-1, 1).expand(-1, hidden)
    results.append(("combine", "grad grouped, last tokens", rel_err(grad_grouped[rows], want)))
    del out, grad_grouped
    gate_up = layout.grouped.detach().view(-1, 2 * hidden)  # rows * 2I passes 2**31 too
    want = swiglu_reference(gate_up[-last:].float())
    results.append(("swiglu", "out, last rows", rel_err(swiglu(gate_up)[-last:], want)))
    return results


# ---- batch-invariant matmul tiles (issue 50) ------------------------------------------------------
# The 48-layer Qwen3-30B-A3B shape's weights on one GPU: (what, N, K, experts or 0).
INVARIANT_WEIGHTS = [
    ("q_proj", 4096, 2048, 0),
    ("k_proj, v_proj", 512, 2048, 0),
    ("o_proj", 2048, 4096, 0),
    ("router", 128, 2048, 0),
    ("lm_head", 151936, 2048, 0),
    ("experts gate_up", 1536, 2048, 128),
    ("experts down", 2048, 768, 128),
]
INVARIANT_ROWS = (1, 64, 8192)  # tokens: a decode step alone, at batch 64, a training micro-batch
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
INVARIANT_CONFIGS = [
    (bm, bn, bk, 4 if bm * bn <= 64 * 64 else 8, stages)
    for bm in (16, 64, 128)
    for bn in (32, 64, 128)
    for bk in (64, 128)
    for stages in (3, 4)
] + [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4)]


def timed_configs(run, configs, reference) -> dict:
    """{config: (ms, whether its output has `reference`'s bits)} of `run(config)` -> (ms, output);
    a config past the GPU's shared memory is infinitely slow and unequal."""
    times = {}
    for config in configs:
        try:
            ms, out = run(config)
            times[config] = (ms, torch.equal(out, reference))
        except Exception as error:
            times[config] = (float("inf"), False)
            report(f"  {config}: {type(error).__name__}")
    return times


def invariant_tile_rows():
    """For each weight of the shape and each row count: the batch-invariant matmul kernel under
    every config of INVARIANT_CONFIGS against the one config it ran before tiles were picked by
    the row count (BLOCK_M 64, BLOCK_K 64, BLOCK_N by the width, 4 warps, 3 stages), cuBLAS /
    torch's grouped GEMM, and what `invariant.matmul` / `invariant.experts`' launch picks now
    (`_tiles`), and that launch with its programs in the order before the grouped one
    (`invariant._tile_of`: M tile fastest over all of them, "M-first"): microseconds, and whether
    a config's output has the same bits as the old one's."""
    from moemesh.ops import invariant

    k_top, row_counts = 8, (1, 5) if SMOKE else INVARIANT_ROWS
    configs = INVARIANT_CONFIGS[:2] if SMOKE else INVARIANT_CONFIGS
    if "--picked-tiles" in sys.argv:  # only the old config and what `_tiles` picks
        configs = []
    report("batch-invariant matmul: configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) against the old one")
    report(
        f"{'weight':<16}{'rows':>6}{'cuBLAS us':>10}{'old us':>8}{'best equal':>24}{'us':>8}{'best any':>24}{'us':>8}"
        f"{'picked':>24}{'us':>8}{'same':>6}{'M-first us':>11}"
    )
    equal_everywhere = dict.fromkeys(configs, True)
    for what, n, k, experts in INVARIANT_WEIGHTS:
        if SMOKE:
            n, k, experts = min(n, 96), min(k, 80), min(experts, 4)
        weight = torch.randn(*((experts,) if experts else ()), n, k, dtype=DTYPE, device=DEVICE) / k**0.5
        for rows in row_counts:
            pairs = rows * k_top if experts else rows
            x = torch.randn(pairs, k, dtype=DTYPE, device=DEVICE)
            if experts:
                ids = torch.stack([torch.randperm(experts, device=DEVICE)[:k_top] for _ in range(rows)]).flatten()
                sizes = torch.bincount(ids, minlength=experts)
                cublas = bench_ms(lambda: grouped_mm(x, weight, sizes), rep=25)
            else:
                sizes = None
                cublas = bench_ms(lambda: x @ weight.T, rep=25)

            def run(config, tile_group=invariant.TILE_GROUP):
                out = x.new_zeros(pairs, n)

                def launch():
                    invariant._launch_matmul(x, weight, out, sizes, pairs, config, tile_group)

                launch()
                return bench_ms(launch, rep=25), out.clone()

            old_bits = 32 if n <= 4096 else 64 if n < 65536 else 128
            old, old_out = run((64, old_bits, 64, 4, 3))
            times = timed_configs(run, configs, old_out)
            for config in configs:
                equal_everywhere[config] &= times[config][1]
            picked = invariant._tiles(pairs // experts if experts else pairs, n, DTYPE)
            picked_ms, picked_out = run(picked)
            m_first_ms, _ = run(picked, tile_group=2**30)
            equal = [c for c in times if times[c][1]]
            best_equal = min(equal, key=lambda c: times[c][0]) if equal else None
            best_any = min(times, key=lambda c: times[c][0]) if times else None
            report(
                f"{what:<16}{rows:>6}{cublas * 1e3:>10.1f}{old * 1e3:>8.1f}{str(best_equal):>24}"
                f"{times[best_equal][0] * 1e3 if best_equal else float('nan'):>8.1f}{str(best_any):>24}"
                f"{times[best_any][0] * 1e3 if best_any else float('nan'):>8.1f}{str(picked):>24}"
                f"{picked_ms * 1e3:>8.1f}{str(torch.equal(picked_out, old_out)):>6}{m_first_ms * 1e3:>11.1f}"
            )
    same = [c for c in configs if equal_everywhere[c]]
    report(f"configs with the old bits for every weight and row count: {len(same)} of {len(configs)}")


# Decoding's per-expert kernel (`expert_gemv._by_expert_kernel`) at the Qwen3-30B-A3B expert bank, a
# tensor-parallel rank's slice of it (intermediate 768 / tp) and a rank's whole experts under `--tp N
# --ep N` (E / tp of them, the step's global ids), timed as a step's graph runs it: at 64 tokens one
# GPU's gate/up and down read at 99% and 92% of the copy rate, a TP=2 rank's whole experts at 95% and
# 85%, a TP=4 rank's slice of down at 59% (docs/benchmarks.md, 2026-11-29, issue 49).
EXPERT_TP = (1, 2, 4)
EXPERT_TOKENS = (32, 64)
# (BLOCK_OUT, BLOCK_K, num_warps, num_stages): the shipped list, then wider blocks of shorter K.
EXPERT_EXTRA_CONFIGS = [(256, 64, 8, 3), (256, 128, 8, 3)] + [  # deeper K steps, more stages: decoded tiles
    (16, 512, 4, 3), (32, 512, 4, 3), (64, 512, 8, 3), (64, 256, 4, 4), (32, 256, 8, 3),
    (128, 256, 8, 3), (32, 128, 4, 6), (64, 128, 4, 5), (16, 256, 4, 6), (64, 64, 4, 6),
]  # fmt: skip


def expert_tile_rows(copy_gbps, formats=("bf16", "tp", "fp8", "mxfp4")):
    """For gate/up (SwiGLU fused) and down, at one GPU's expert bank, TP=2 and 4 ranks' slices and
    their whole experts (bf16), and the one GPU's bank kept in FP8 and MXFP4 (tiles decoded in
    registers): the kernel under each config of BY_EXPERT_CONFIGS and EXPERT_EXTRA_CONFIGS, and
    as shipped (its autotuner's pick): microseconds and GB/s over the bytes of the chosen experts
    that the rank holds (codes and scales for a quantized bank); each a dependent launch, 48 of
    them in a CUDA graph, as a decode step runs them (a bank of weights is far larger than L2:
    none is read from there again)."""
    import triton

    from moemesh.ops import expert_gemv as module
    from moemesh.ops.quantized_weight import kernel_operands

    kernel = module._by_expert_kernel
    jit = getattr(kernel, "fn", None) or kernel.kernel  # triton's autotuner, or the CPU's first config
    shipped = [
        (c.kwargs["BLOCK_OUT"], c.kwargs["BLOCK_K"], c.num_warps, c.num_stages) for c in module.BY_EXPERT_CONFIGS
    ]
    configs = (shipped + EXPERT_EXTRA_CONFIGS)[: 2 if SMOKE else None]
    k, hidden, experts, inner = (SIZES[n] for n in ("k", "hidden", "experts", "inner"))
    dtype = torch.float32 if SMOKE else DTYPE  # the interpreter's tl.dot is wrong in bf16
    report(f"decoding's per-expert kernel: configs (BLOCK_OUT, BLOCK_K, warps, stages), E={experts}, top-{k}")
    report(
        f"{'projection':<38}{'tokens':>7}{'shipped us':>11}{'GB/s':>7}{'best config':>22}{'us':>8}{'GB/s':>7}"
        f"{'%copy':>7}"
    )
    layouts = [(1, "", fmt) for fmt in ("bf16", "fp8", "mxfp4") if fmt in formats]
    layouts += [(tp, how, "bf16") for tp in EXPERT_TP[1:] for how in ("slices", "whole") if "tp" in formats]
    layouts = [layout for layout in layouts if layout[2] != "mxfp4" or not (hidden % 32 or inner % 32)]
    for tp, how, fmt in layouts:
        bank, part = (experts // tp, inner) if how == "whole" else (experts, inner // tp)
        for name, out_features, width, glu in (("gate/up", part, hidden, True), ("down", hidden, part, False)):
            rows_per_expert = 2 * out_features if glu else out_features
            weight = _bank(bank, rows_per_expert, width, fmt, dtype)
            codes, scales, stride, offset, constants = kernel_operands(weight, dtype)
            for tokens in (2, 3) if SMOKE else EXPERT_TOKENS:
                x = torch.randn(tokens, width, dtype=dtype, device=DEVICE)
                ids = torch.stack([torch.randperm(experts, device=DEVICE)[:k] for _ in range(tokens)]).contiguous()
                nbytes = int((ids.unique() < bank).sum()) * _weight_bytes(weight) // bank  # the bank: 0 .. bank - 1
                out = x.new_empty(tokens * k, out_features)

                def run(config):
                    block_out, block_k, warps, stages = config
                    grid = (bank, triton.cdiv(out_features, block_out))
                    launch = functools.partial(
                        jit[grid], x, codes, scales, ids, out, tokens * k, width, out_features,
                        triton.next_power_of_2(tokens * k), 0, stride, offset, PAIRS_PER_X=k, GLU=glu,
                        PRECISION="tf32", AS_DECODED=fmt == "bf16", BLOCK_OUT=block_out,
                        BLOCK_K=block_k, num_warps=warps, num_stages=stages, **constants, **dependent_launch(x),
                    )  # fmt: skip
                    return launches_us(lambda i: launch(), 1)

                times = {}
                for config in configs:
                    try:
                        times[config] = run(config)
                    except Exception as error:  # a config past the GPU's registers or shared memory
                        times[config] = float("inf")
                        report(f"  {config}: {type(error).__name__}")
                as_shipped = launches_us(lambda i: module.expert_gemv_triton(x, weight, ids, glu=glu), 1)
                best = min(times, key=times.get)
                what = f"{name}, {fmt}, tp={tp} {how} [{bank}x{rows_per_expert}x{width}]"
                report(
                    f"{what:<38}{tokens:>7}{as_shipped:>11.1f}{nbytes / as_shipped / 1e3:>7.0f}{str(best):>22}"
                    f"{times[best]:>8.1f}{nbytes / times[best] / 1e3:>7.0f}"
                    f"{nbytes / times[best] / 1e3 / copy_gbps:>7.0%}"
                )
                report("    " + " ".join(f"{c}: {t:.1f}" for c, t in times.items()))


def selected_tile_rows(copy_gbps):
    """--selected-tiles: batch-invariant mode's decode-step experts (`invariant._selected_matmul`,
    a program an expert's N tile, its pairs found by scanning the ids) at 64 tokens of top-8 over
    the 128 experts of the Qwen3-30B-A3B shape, gate_up and down, under every config of
    INVARIANT_CONFIGS (38) against the grouped launch's config (`_tiles`,
    what it launched before) and what it launches now (`_selected_tiles`): µs, GB/s of the weights
    read, and whether a config's output has the grouped config's bits."""
    import triton

    from moemesh.ops import invariant

    tokens, k_top, experts = (5, 2, 4) if SMOKE else (64, 8, 128)
    configs = INVARIANT_CONFIGS[:2] if SMOKE else INVARIANT_CONFIGS
    report(
        "batch-invariant decode experts (_selected_matmul_kernel): configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)"
    )
    report(
        f"{'weight':<16}{'tokens':>7}{'grouped config':>24}{'us':>8}{'shipped':>24}{'us':>8}{'best equal':>24}"
        f"{'us':>8}{'GB/s':>6}{'%copy':>6}"
    )
    for what, n, k, per_x in (("experts gate_up", 1536, 2048, k_top), ("experts down", 2048, 768, 1)):
        if SMOKE:
            n, k = min(n, 96), min(k, 80)
        weight = torch.randn(experts, n, k, dtype=DTYPE, device=DEVICE) / k**0.5
        ids = torch.stack([torch.randperm(experts, device=DEVICE)[:k_top] for _ in range(tokens)]).contiguous()
        x = torch.randn(tokens * k_top // per_x, k, dtype=DTYPE, device=DEVICE)
        pairs = ids.numel()
        nbytes = int(ids.unique().numel()) * n * k * weight.element_size()
        picked = invariant._tiles(pairs // experts, n, DTYPE)
        shipped = invariant._selected_tiles(picked, k)

        def run(config):
            out = x.new_empty(pairs, n)

            def launch():
                invariant._selected_matmul_kernel[(experts, triton.cdiv(n, config[1]))](
                    x, weight, ids, out, pairs, n, k, x.stride(0), x.stride(1), *weight.stride(), out.stride(0),
                    PAIRS_PER_X=per_x, **invariant._launch_meta(DTYPE, config),
                )  # fmt: skip

            launch()
            return bench_ms(launch, rep=25), out.clone()

        picked_ms, picked_out = run(picked)
        shipped_ms, shipped_out = run(shipped)
        assert torch.equal(invariant._selected_matmul(x, weight, ids, per_x), shipped_out)
        times = timed_configs(run, configs, picked_out)
        equal = [c for c in times if times[c][1]]
        best = min(equal, key=lambda c: times[c][0]) if equal else picked
        best_ms = times[best][0] if equal else picked_ms
        report(
            f"{what:<16}{tokens:>7}{str(picked):>24}{picked_ms * 1e3:>8.1f}{str(shipped):>24}{shipped_ms * 1e3:>8.1f}"
            f"{str(best):>24}{best_ms * 1e3:>8.1f}{nbytes / best_ms / 1e6:>6.0f}"
            f"{nbytes / best_ms / 1e6 / copy_gbps:>6.0%}"
        )
        unequal = [c for c in times if not times[c][1] and times[c][0] < float("inf")]
        if not torch.equal(shipped_out, picked_out):
            unequal.append("shipped")
        report(f"  configs with other bits: {unequal or 'none'}")


# Decoding's projections through `ops/gemv.py` at the 48-layer Qwen3-30B-A3B shape, one GPU and a
# tensor-parallel rank's share (q, k, v in one launch; o_proj; the router, whole on every rank), a
# launch's time inside a CUDA graph as a decode step runs it (issue 49).
GEMV_TP = (1, 2, 4)
GEMV_ROWS = (1, 16, 64)
# (BLOCK_OUT, BLOCK_K, num_warps) beyond the shipped list, for the sweep.
GEMV_EXTRA_CONFIGS = [(64, 64, 4), (128, 64, 4), (64, 256, 8), (128, 128, 8)]
GEMV_LAUNCHES = 48  # a layer's worth each, captured in one CUDA graph


def launches_us(launch, copies, launches=GEMV_LAUNCHES):
    """µs a launch of `launch(i)`, `launches` of them cycling over `copies` sets of weights
    (a set read again only after the others have passed through L2, and triton's benchmark empties
    L2 before each replay: weights from memory, as a decode step's) captured in one CUDA graph and
    replayed: the kernel's time as a decode step's graph runs it, without the host's cost of a
    launch."""
    if SMOKE:
        start = time.perf_counter()
        launch(0)
        return (time.perf_counter() - start) * 1e6
    launch(0)  # compiled (and tuned) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            launch(i % copies)
    return bench_ms(graph.replay, rep=25) * 1e3 / launches


def gemv_tile_rows(copy_gbps):
    """Each projection at each number of rows: cuBLAS (one F.linear of the weights concatenated),
    the kernel as shipped (its autotuner's pick), and every config of gemv.CONFIGS and
    GEMV_EXTRA_CONFIGS (the best), each a dependent launch as the shipped one is where the GPU
    takes them: µs a launch inside a CUDA graph, and GB/s over the weights' bytes."""
    import triton

    from moemesh.ops import gemv as module

    kernel = module._gemv_kernel
    jit = getattr(kernel, "fn", None) or kernel.kernel  # triton's autotuner, or the CPU's first config
    shipped = [(c.kwargs["BLOCK_OUT"], c.kwargs["BLOCK_K"], c.num_warps) for c in module.CONFIGS]
    configs = (shipped + GEMV_EXTRA_CONFIGS)[: 3 if SMOKE else None]
    hidden, heads, kv_heads, dim, experts = (64, 4, 2, 16, 8) if SMOKE else (2048, 32, 4, 128, 128)
    dtype = torch.float32 if SMOKE else DTYPE  # the CPU interpreter's tl.dot is wrong in bf16
    precision = "ieee" if SMOKE else "tf32"
    failed = {}
    report("decoding's projections (ops/gemv.py): configs (BLOCK_OUT, BLOCK_K, warps); µs a launch")
    report(
        f"{'projection':<24}{'rows':>5}{'cuBLAS':>8}{'shipped':>9}{'GB/s':>6}{'best':>17}{'us':>7}{'GB/s':>6}{'%copy':>6}"
    )
    for tp in GEMV_TP:
        projections = {
            "q, k, v": [(heads // tp * dim, hidden)] + [(max(1, kv_heads // tp) * dim, hidden)] * 2,
            "o_proj": [(hidden, heads // tp * dim)],
            "router": [(experts, hidden)],
        }
        for name, shapes in projections.items():
            inner = shapes[0][1]
            nbytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
            copies = 1 if SMOKE else min(GEMV_LAUNCHES, max(2, 2**28 // nbytes))  # none unused by the graph
            weight_sets = [
                [torch.randn(n, k, dtype=dtype, device=DEVICE) / k**0.5 for n, k in shapes] for _ in range(copies)
            ]
            wholes = [torch.cat(weights) for weights in weight_sets]
            for rows in (1, 2) if SMOKE else GEMV_ROWS:
                x = torch.randn(rows, inner, dtype=dtype, device=DEVICE)
                tile_rows = 1 if rows == 1 else max(16, triton.next_power_of_2(rows))
                sizes = [n for n, _ in shapes] + [0] * (3 - len(shapes))
                outs = [x.new_empty(rows, n) for n in sizes]
                offered = {c for c in configs if tile_rows == 1 or c[0] >= 16}  # as gemv._one_row_tiles

                def run(config):
                    block_out, block_k, warps = config
                    grid = (sum(triton.cdiv(n, block_out) for n in sizes),)

                    def launch(i):
                        padded = weight_sets[i] + [weight_sets[i][0]] * (3 - len(shapes))
                        jit[grid](
                            x, *padded, *outs, *sizes, rows, inner, triton.next_power_of_2(rows),
                            ROWS=tile_rows, PRECISION=precision, PREFETCH=True, **dependent_launch(x),
                            BLOCK_OUT=block_out, BLOCK_K=block_k, num_warps=warps,
                        )  # fmt: skip

                    launch(0)
                    expected = x.float() @ wholes[0].float().T
                    error = rel_err(torch.cat(outs[: len(shapes)], dim=1), expected)
                    if error > BF16_TOLERANCE:
                        raise ValueError(f"wrong: {error:.1e}")
                    return launches_us(launch, copies)

                times = {}
                for config in sorted(offered):
                    try:
                        times[config] = run(config)
                    except Exception as error:  # a config past the GPU's registers or shared memory
                        times[config] = float("inf")
                        failed.setdefault((config, type(error).__name__), str(error)[:90])
                cublas = launches_us(lambda i: F.linear(x, wholes[i]), copies)
                as_shipped = launches_us(lambda i: module.gemv(x, weight_sets[i]), copies)
                best = min(times, key=times.get)
                report(
                    f"{f'{name}, tp={tp} [{sum(sizes)}x{inner}]':<24}{rows:>5}{cublas:>8.1f}"
                    f"{as_shipped:>9.1f}{nbytes / as_shipped / 1e3:>6.0f}{str(best):>17}{times[best]:>7.1f}"
                    f"{nbytes / times[best] / 1e3:>6.0f}{nbytes / times[best] / 1e3 / copy_gbps:>6.0%}"
                )
    for (config, kind), message in failed.items():
        report(f"  {config} failed at some rows: {kind}: {message}")


# (tokens a tile, warps, stages, the strides told aligned, the blocks a tile sees whole unmasked,
# keys a block: invariant.ATTENTION_KEYS) of the attention kernel over whole sequences: a tile's
# query rows are its tokens × the group (8 for Qwen3-30B-A3B's 32 query heads of 4 key/value
# heads); the engine's tile is `invariant.tile_tokens`' (8 tokens: 64 rows, 4 warps, 2 stages, 64
# keys), the trainer's in bf16 WHOLE_SEQUENCE_ROWS' (32 tokens: 256 rows, 16 warps).
INVARIANT_ATTENTION_CONFIGS = [
    (8, 4, 2, True, True, 64), (16, 8, 2, True, True, 64), (32, 8, 2, True, True, 64),
    (32, 16, 2, True, False, 64), (32, 16, 2, True, True, 64), (32, 16, 3, True, True, 64),
    (8, 4, 2, True, True, 128), (16, 8, 2, True, True, 128), (32, 16, 2, True, True, 128),
    (32, 8, 2, True, True, 128), (32, 16, 3, True, True, 128),
]  # fmt: skip


def invariant_attention_rows():
    """--invariant-attention: the batch-invariant attention kernel over whole sequences (a training
    step's: 4 of 2,048 tokens, the Qwen3-30B-A3B shape's heads) with other query tiles, warps,
    stages and keys a block than the trainer's, the blocks a tile sees whole masked or not,
    against torch's attention (SDPA): microseconds, and whether every query's output has the bits
    of the engine's tile with the same keys a block (64: the trainer's) — a tile for training is
    only usable where the bits are the same. Then a decode step's tiles (`decode_attention_rows`),
    and forward and backward together: SDPA's and the kernel's with cuDNN's or flash attention's
    backward fed its output and log-sum-exp (`invariant.causal_attention`), each gradient against
    fp32 attention's."""
    import triton

    from moemesh.ops import invariant

    batch, seq, heads, kv_heads, dim = (1, 40, 4, 2, 16) if SMOKE else (4, 2048, 32, 4, 128)
    q = torch.randn(batch, seq, heads, dim, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(batch, seq, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(2))
    scale = dim**-0.5
    group = heads // kv_heads
    flat = (
        q.reshape(batch * seq, heads, dim),
        k.reshape(batch * seq, kv_heads, dim),
        v.reshape(batch * seq, kv_heads, dim),
    )
    shipped = invariant.causal_attention(q, k, v, scale)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(1, 2)

    sdpa_ms = bench_ms(lambda: sdpa(q, k, v))
    report(f"batch-invariant attention, {batch} sequences of {seq} tokens, {heads} heads of {kv_heads}, dim {dim}")
    report(f"torch SDPA (causal) forward: {sdpa_ms * 1e3:.1f} us")
    columns = ("tokens a tile", 14), ("rows", 6), ("warps", 6), ("stages", 7), ("aligned", 8), ("unmasked", 9)
    columns += (("keys", 6),)
    report("".join(f"{name:>{width}}" for name, width in columns) + f"{'us':>10}{'x SDPA':>8}{'same bits':>10}")
    report("(same bits: as the first row with the same keys a block, the engine's tile; 64 keys: the shipped launch's)")
    first_of = {invariant.ATTENTION_KEYS: shipped}
    for tokens, warps, stages, aligned, unmasked, keys in (
        INVARIANT_ATTENTION_CONFIGS[:2] if SMOKE else INVARIANT_ATTENTION_CONFIGS
    ):
        rows = max(16, triton.next_power_of_2(tokens * group))  # the program's query rows, as the launch makes them
        args = invariant._whole_sequences(batch, seq, tokens, q.device)

        def launch():
            return invariant._launch_attention(*flat, *args, scale, tokens, warps=warps, stages=stages, aligned=aligned)

        row = f"{tokens:>14}{rows:>6}{warps:>6}{stages:>7}{str(aligned):>8}{str(unmasked):>9}{keys:>6}"
        shipped_keys, shipped_unmasked = invariant.ATTENTION_KEYS, invariant.UNMASKED_WHOLE_BLOCKS
        invariant.ATTENTION_KEYS, invariant.UNMASKED_WHOLE_BLOCKS = keys, unmasked
        try:
            out = launch().view_as(shipped)
            same = torch.equal(out, first_of.setdefault(keys, out))
            ms = bench_ms(launch)
        except Exception as error:  # past the GPU's registers or shared memory
            report(f"{row}  {type(error).__name__}")
            continue
        finally:
            invariant.ATTENTION_KEYS, invariant.UNMASKED_WHOLE_BLOCKS = shipped_keys, shipped_unmasked
        report(f"{row}{ms * 1e3:>10.1f}{ms / sdpa_ms:>8.2f}{str(same):>10}")

    decode_attention_rows(heads, kv_heads, dim)
    grad = torch.randn_like(shipped)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(sdpa(*(t.float() for t in leaves)), leaves, grad.float())

    def shipped_attention(q, k, v):
        return invariant.causal_attention(q, k, v, scale)

    fused_backward = invariant._fused_backward

    shipped_backend = invariant._fused_backward(q)
    report(f"{'forward and backward':<44}{'us':>10}{'x SDPA':>8}{'dq, dk, dv rel. err. vs fp32':>32}")
    base = None
    for name, attend, backend in (
        ("torch SDPA (the default path)", sdpa, shipped_backend),
        *((f"kernel, {b} backward from its lse{' (shipped)' * (b == shipped_backend)}", shipped_attention, b)
          for b in (() if SMOKE else ("cudnn", "flash"))),
    ):  # fmt: skip
        invariant._fused_backward = lambda q, backend=backend: backend  # the backward's kernel, for this row
        try:
            grads = torch.autograd.grad(attend(*leaves), leaves, grad)
            ms = bench_ms(lambda: torch.autograd.grad(attend(*leaves), leaves, grad))
        except Exception as error:  # a backend this torch or GPU lacks
            report(f"{name:<44}  {type(error).__name__}: {str(error)[:80]}")
            continue
        finally:
            invariant._fused_backward = fused_backward
        errors = ", ".join(f"{rel_err(ours, theirs):.1e}" for ours, theirs in zip(grads, expected))
        base = base or ms
        report(f"{name:<44}{ms * 1e3:>10.1f}{ms / base:>8.2f}{errors:>32}")


# (warps, stages, keys a block) of the engine's decode tiles (one token × the group's query heads);
# the first shipped.
DECODE_ATTENTION_CONFIGS = [(4, 2, 64), (4, 3, 64), (8, 3, 64), (4, 2, 128), (4, 3, 128)]


def decode_attention_rows(heads, kv_heads, dim):
    """A decode step's batch-invariant attention (`bench/serve/decode.py --batch-invariant`'s batch 64 at
    288 tokens): each sequence's last token over its keys (the engine's tile of one token), with
    other warps, stages and keys a block than the engine's; µs, and whether every query's output
    has the bits of the first config with its keys a block (64: the shipped launch's)."""
    from moemesh.ops import invariant

    batch, seq, scale = (2, 40, dim**-0.5) if SMOKE else (64, 288, dim**-0.5)
    q = torch.randn(batch, seq, heads, dim, dtype=DTYPE, device=DEVICE)
    k, v = (torch.randn(batch, seq, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(2))
    rows = torch.arange(batch, device=q.device, dtype=torch.int32)
    args = (
        rows[:, None].contiguous(),  # each sequence's keys one block of seq
        seq,
        rows,
        torch.full((batch,), seq - 1, device=q.device, dtype=torch.int32),
        rows,
        torch.ones(batch, device=q.device, dtype=torch.int32),
        torch.full((1,), batch, device=q.device, dtype=torch.int32),
        scale,
        invariant.tile_tokens(heads // k.shape[2]),
    )
    last = q[:, -1].contiguous()
    pools = k.reshape(batch * seq, *k.shape[2:]), v.reshape(batch * seq, *v.shape[2:])
    shipped = invariant._launch_attention(last, *pools, *args)
    report(f"decode step: {batch} sequences' last tokens over {seq} keys")
    report(f"{'warps':>6}{'stages':>7}{'keys':>6}{'us':>10}{'same bits':>10}  (as the first row with those keys)")
    first_of = {invariant.ATTENTION_KEYS: shipped}
    for warps, stages, keys in DECODE_ATTENTION_CONFIGS[:1] if SMOKE else DECODE_ATTENTION_CONFIGS:

        def launch():
            return invariant._launch_attention(last, *pools, *args, warps=warps, stages=stages)

        shipped_keys, invariant.ATTENTION_KEYS = invariant.ATTENTION_KEYS, keys
        try:
            out = launch()
            same = torch.equal(out, first_of.setdefault(keys, out))
            report(f"{warps:>6}{stages:>7}{keys:>6}{bench_ms(launch) * 1e3:>10.1f}{str(same):>10}")
        finally:
            invariant.ATTENTION_KEYS = shipped_keys


class _LinearFunction(torch.autograd.Function):
    """F.linear in a custom autograd Function (--launches: the Function's own host cost)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return F.linear(x, w)


# --grid-barrier: what a boundary between two dependent kernels of a decode step costs, against the
# same boundary inside one persistent kernel (every program resident, meeting at a counter). A
# phase is a program's one read of what another program wrote in the phase before, and one write.
BARRIER_PHASES = 48 * 11  # a 48-layer step's boundaries, about 11 a layer


def grid_barrier_rows() -> None:
    """µs a phase: PHASES one-phase kernels as dependent launches (as a step's) in a CUDA graph,
    and one persistent kernel of PHASES phases with a grid barrier after each, at several numbers
    of programs (at most one a streaming multiprocessor for the persistent kernel: all resident)."""
    sms = 1 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    phases = 4 if SMOKE else BARRIER_PHASES
    report(f"{'programs':>9}{'dependent launches µs a phase':>32}{'grid barrier µs a phase':>26}")
    for programs in sorted({sms, max(1, sms // 2), max(1, sms // 4)}):
        buffers = torch.zeros(2, programs, dtype=torch.float32, device=DEVICE)
        counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)

        def launches(buffers=buffers, programs=programs):
            for p in range(phases):
                _phase_kernel[(programs,)](buffers[p % 2], buffers[1 - p % 2], programs, **dependent_launch(buffers))

        def persistent(buffers=buffers, counter=counter, programs=programs):
            counter.zero_()
            _phases_kernel[(programs,)](buffers, counter, programs, phases)

        launched = launches_us(lambda i: launches(), 1, launches=1) / phases  # all the phases, one graph
        met = launches_us(lambda i: persistent(), 1, launches=1) / phases
        report(f"{programs:>9}{launched:>32.2f}{met:>26.2f}")
        buffers.zero_()
        persistent()
        sync()  # each phase adds one to each value, read from another program's
        assert int(buffers[phases % 2].min()) == phases, "the grid barrier let a program read too early"


@triton.jit
def _phase_kernel(src_ptr, dst_ptr, programs, GDC: tl.constexpr):
    wait_for_inputs(GDC)
    i = tl.program_id(0)
    tl.store(dst_ptr + i, tl.load(src_ptr + (i + 1) % programs) + 1.0)


@triton.jit
def _phases_kernel(buffers_ptr, counter_ptr, programs, phases):
    i = tl.program_id(0)
    for p in range(phases):
        src = buffers_ptr + (p % 2) * programs
        dst = buffers_ptr + (1 - p % 2) * programs
        tl.store(dst + i, tl.load(src + (i + 1) % programs, volatile=True) + 1.0)
        tl.debug_barrier()  # every thread's store issued before the program arrives
        tl.atomic_add(counter_ptr, 1, sem="release")
        while tl.atomic_add(counter_ptr, 0, sem="acquire") < (p + 1) * programs:
            pass


@torch.no_grad()
def no_grad_linear(x, w):
    from moemesh.ops import invariant

    return invariant.linear(x, w)


def dequantize_tile_rows(copy_gbps):
    """A LoRA run's quantized expert bank dequantized to bf16 (ops/quantized_weight.py): the
    Qwen3-30B-A3B gate_up bank in block FP8 and gpt-oss-120b's in MXFP4, per program tile."""
    from moemesh.checkpoint.quantized import quantize_fp8, quantize_mxfp4
    from moemesh.ops.quantized_weight import FP8_TILE, QuantizedWeight, dequantize_reference, dequantize_triton

    fused_product_rows()
    report()
    experts = 8 if SMOKE else 128
    banks = {}
    for fmt, (rows, cols) in (("fp8", (1536, 2048)), ("mxfp4", (5760, 2880))):
        rows, cols = (rows // 16, 64) if SMOKE else (rows, cols)
        codes, scales = [], []
        for _ in range(0, experts, 8):
            w = torch.randn(8, rows, cols, device=DEVICE) * 0.02
            q, s = quantize_fp8(w) if fmt == "fp8" else quantize_mxfp4(w)
            codes.append(q)
            scales.append(s.repeat_interleave(FP8_TILE, -2)[..., :rows, :].contiguous() if fmt == "fp8" else s)
        banks[fmt] = QuantizedWeight(fmt, torch.cat(codes), torch.cat(scales))
    report("quantized bank -> bf16, GB/s (codes and scales read + bf16 written) and vs the device copy:")
    report(f"  {'format':<6} {'bank':<18} {'rows x cols x warps':<20} {'ms':>8} {'GB/s':>8} {'vs copy':>8}  exact")
    for fmt, bank in banks.items():
        moved = bank.nbytes + bank.numel() * 2
        reference = dequantize_reference(bank.experts(slice(0, 2)), torch.bfloat16)
        for tile in (
            (16, 128, 4),
            (16, 512, 8),
            (32, 256, 4),
            (8, 1024, 8),
            (64, 128, 8),
            (16, 1024, 8),
            (8, 2048, 8),
            (4, 2048, 4),
        ):
            ms = bench_ms(lambda t=tile: dequantize_triton(bank, torch.bfloat16, t))
            exact = torch.equal(dequantize_triton(bank.experts(slice(0, 2)), torch.bfloat16, tile), reference)
            shape = "x".join(map(str, bank.shape))
            report(
                f"  {fmt:<6} {shape:<18} {'x'.join(map(str, tile)):<20} {ms:>8.3f} {moved / ms / 1e6:>8.0f} "
                f"{moved / ms / 1e6 / copy_gbps:>8.0%}  {exact}"
            )


def fused_product_rows():
    """The forward's product over a quantized bank two ways: dequantized, then torch's grouped
    GEMM, against ops/quantized_grouped_mm.py's kernel decoding the tiles in registers (per
    tile), on a LoRA step's rows: 4,096 tokens top-8 of the Qwen3-30B-A3B shape in FP8, top-4 of
    gpt-oss-120b's in MXFP4 (a format the kernel is not used for: the bench shows why), routed
    with a trained router's skew (expert popularity log-normal, sigma 0.5)."""
    from moemesh.ops import grouped_mm as grouped
    from moemesh.ops.quantized_grouped_mm import TILE, quantized_grouped_mm
    from moemesh.ops.quantized_weight import dequantize

    tokens = 64 if SMOKE else 4096
    tiles = [TILE] if SMOKE else [
        TILE, (128, 128, 64, 4, 4), (128, 128, 64, 4, 2), (128, 128, 64, 8, 3), (128, 128, 128, 4, 3),
        (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (64, 128, 64, 4, 3),
    ]  # fmt: skip
    report("a bank's forward product: dequantize + grouped GEMM against the fused kernel (us; equal: bit for bit):")
    header = f"{'tile (M,N,K,warps,stages)':<26} {'fused us':>9} {'TFLOP/s':>8} {'dequant+GEMM':>13} {'equal':>6}"
    report(f"  {'bank':<28} {header}")
    shapes = [("fp8 gate_up", "fp8", 128, 1536, 2048, 8), ("fp8 down", "fp8", 128, 2048, 768, 8),
              ("mxfp4 gate_up (gpt-oss-120b)", "mxfp4", 128, 5760, 2880, 4)]  # fmt: skip
    for name, fmt, experts, rows, cols, k in shapes:
        if SMOKE:
            experts, rows, cols = 8, 64, 256
        bank = _bank(experts, rows, cols, fmt, DTYPE)
        popularity = torch.exp(torch.randn(experts, device=DEVICE) * 0.5)
        chosen = torch.multinomial(popularity.expand(tokens, experts), k)
        sizes = torch.bincount(chosen.flatten(), minlength=experts).to(torch.int32)
        x = torch.randn(tokens * k, cols, device=DEVICE, dtype=DTYPE)
        offsets = grouped.group_offsets(x, sizes)
        dense_ms = bench_ms(lambda: grouped.product(x, dequantize(bank, DTYPE), sizes, offsets))
        want = grouped.product(x, dequantize(bank, DTYPE), sizes, offsets)
        flops = 2 * tokens * k * rows * cols
        for tile in tiles:
            ms = bench_ms(lambda t=tile: quantized_grouped_mm(x, bank, sizes, t))
            equal = torch.equal(quantized_grouped_mm(x, bank, sizes, tile), want)
            report(
                f"  {name:<28} {str(tile):<26} {ms * 1e3:>9.0f} {flops / ms / 1e9:>8.0f} {dense_ms * 1e3:>13.0f} "
                f"{str(equal):>6}"
            )
        if fmt == "fp8" and not SMOKE:
            overlap_rows(name, x, bank, sizes, offsets)


def overlap_rows(name, x, bank, sizes, offsets):
    """Whether a bank's dequantization hides behind another bank's grouped GEMM when the two run
    on two streams (a prefetch of the next layer's dense bank): the GEMM alone, the
    dequantization alone, both one after the other, and both at once (us)."""
    from moemesh.ops import grouped_mm as grouped
    from moemesh.ops.quantized_weight import dequantize, dequantize_triton

    dense = dequantize(bank, DTYPE)
    side = torch.cuda.Stream()
    for tile in (None, (16, 1024, 8), (64, 2048, 8)):

        def deq(t=tile):
            return dequantize_triton(bank, DTYPE, t)

        def gemm():
            return grouped.product(x, dense, sizes, offsets)

        def serial():
            deq()
            gemm()

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                deq()
            gemm()
            torch.cuda.current_stream().wait_stream(side)

        times = [bench_ms(f) * 1e3 for f in (gemm, deq, serial, both)]
        report(
            f"  overlap {name:<20} dequant tile {str(tile):<14} GEMM {times[0]:>5.0f}  dequant {times[1]:>5.0f}  "
            f"serial {times[2]:>5.0f}  two streams {times[3]:>5.0f}"
        )


def _quantized(weight: torch.Tensor, fmt: str):
    """`weight` [..., R, C] as the decoding kernels take it: itself (bf16), or a QuantizedWeight
    by the published rules (fp8: 128 x 128 tiles, the scales per row; mxfp4: 32-groups)."""
    from moemesh.checkpoint.quantized import quantize_fp8, quantize_mxfp4
    from moemesh.ops.quantized_weight import FP8_TILE, QuantizedWeight

    if fmt == "bf16":
        return weight
    if fmt == "mxfp4":
        return QuantizedWeight("mxfp4", *quantize_mxfp4(weight), weight.dtype)
    codes, tiles = quantize_fp8(weight)
    scales = tiles.repeat_interleave(FP8_TILE, -2)[..., : weight.shape[-2], :].contiguous()
    return QuantizedWeight("fp8", codes, scales, weight.dtype)


def _bank(experts: int, rows: int, cols: int, fmt: str, dtype):
    """A random bank [experts, rows, cols] in `fmt`, made 8 experts at a time."""
    from moemesh.ops.quantized_weight import QuantizedWeight

    pieces = [
        _quantized((torch.randn(min(8, experts - e), rows, cols, device=DEVICE) * 0.02).to(dtype), fmt)
        for e in range(0, experts, 8)
    ]
    if fmt == "bf16":
        return torch.cat(pieces)
    return QuantizedWeight(
        fmt, torch.cat([q.codes for q in pieces]), torch.cat([q.scales for q in pieces]), dtype, pieces[0].offset
    )


def _weight_bytes(weight) -> int:
    return weight.nbytes if hasattr(weight, "codes") else weight.numel() * weight.element_size()


def quantized_gemv_rows(copy_gbps):
    """--quantized-gemv: decoding's kernels on quantized weights (codes and scales decoded in
    registers) beside the same kernels on bf16: µs a launch inside a CUDA graph (`launches_us`:
    the attention weights cycle over copies that do not fit L2 together, the experts are chosen
    afresh each launch from a bank larger than L2, as a decode step reads them), GB/s of the weight
    bytes each launch reads (codes and scales; the chosen experts') and that against a device copy,
    and the error against the dequantize-then-reference. Shapes: Qwen3-30B-A3B's attention (q, k, v
    in one launch; o_proj) and experts (128, top-8, 2048 x 768), gpt-oss-120b's experts (128, top-4,
    2880 x 2880; one token: its per-token kernels for experts with biases, gate/up then down)."""
    from moemesh.ops import gemv
    from moemesh.ops.expert_gemv import expert_gemv, expert_gemv_combine, expert_pair_gemv, expert_swiglu_gemv

    dtype = torch.float32 if SMOKE else DTYPE  # the interpreter's tl.dot is wrong in bf16
    scale = 16 if SMOKE else 1
    formats = ("bf16", "fp8", "mxfp4")
    report("decoding kernels on quantized weights: µs a launch in a CUDA graph, GB/s of the weight bytes read, vs copy")
    report(
        f"  {'kernel':<44} {'weights':<6} {'tokens':>6} {'us':>8} {'GB/s':>8} {'vs copy':>8} {'rel err':>9} "
        f"{'≠ dense':>8}"
    )
    report("  (≠ dense: the share of outputs not bit-equal to the same kernel's on the weights dequantized)")

    def row(name, fmt, tokens, launch, copies, reference, read, dense=None):
        us = launches_us(launch, copies)
        out = launch(0)
        err = rel_err(out, reference())
        differ = "" if dense is None else f"{(out != dense()).float().mean().item():>8.1%}"
        report(
            f"  {name:<44} {fmt:<6} {tokens:>6} {us:>8.1f} {read / us / 1e3:>8.0f} "
            f"{read / us / 1e3 / copy_gbps:>8.0%} {err:>9.1e} {differ}"
        )

    hidden, heads = 2048 // scale, 4096 // scale
    for fmt in formats:

        def projections(*shapes):
            return [_quantized((torch.randn(n, k, device=DEVICE) * 0.02).to(dtype), fmt) for n, k in shapes]

        one = projections((heads, hidden), (512, hidden), (512, hidden))
        copies = 1 if SMOKE else max(2, 2**28 // sum(map(_weight_bytes, one)))
        qkv = [one] + [projections((heads, hidden), (512, hidden), (512, hidden)) for _ in range(copies - 1)]
        o_proj = [projections((hidden, heads))[0] for _ in range(copies)]
        for tokens in (1, 64):
            x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
            a = torch.randn(tokens, heads, device=DEVICE, dtype=dtype)
            with torch.no_grad():
                row("gemv q, k, v (Qwen3-30B-A3B)", fmt, tokens, lambda i: gemv.gemv(x, qkv[i])[0], copies,
                    lambda: gemv.gemv_reference(x, qkv[0])[0], sum(map(_weight_bytes, qkv[0])),
                    lambda: gemv.gemv(x, [w.to(dtype) for w in qkv[0]])[0])  # fmt: skip
                row("gemv o_proj", fmt, tokens, lambda i: gemv.gemv(a, [o_proj[i]])[0], copies,
                    lambda: gemv.gemv_reference(a, [o_proj[0]])[0], _weight_bytes(o_proj[0]),
                    lambda: gemv.gemv(a, [o_proj[0].to(dtype)])[0])  # fmt: skip
    for shape, experts, k, hidden, inner in (
        ("Qwen3-30B-A3B", 128, 8, 2048, 768),
        ("gpt-oss-120b", 128, 4, 2880, 2880),
    ):
        experts, hidden, inner = (8, 96, 64) if SMOKE else (experts, hidden, inner)
        k = min(k, experts)
        plain = shape == "gpt-oss-120b"  # its experts have biases: no fused activation
        for fmt in formats:
            if fmt == "mxfp4" and (hidden % 32 or inner % 32):
                continue
            gate_up, down = _bank(experts, 2 * inner, hidden, fmt, dtype), _bank(experts, hidden, inner, fmt, dtype)
            per_expert = (_weight_bytes(gate_up) + _weight_bytes(down)) / experts
            dense_up = gate_up if fmt == "bf16" else gate_up.to(dtype)
            dense_down = down if fmt == "bf16" else down.to(dtype)
            for tokens in (1, 64):
                x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype)
                draws = 1 if SMOKE else GEMV_LAUNCHES
                ids = [
                    torch.stack([torch.randperm(experts, device=DEVICE)[:k] for _ in range(tokens)])
                    for _ in range(draws)
                ]
                weights = torch.rand(tokens, k, device=DEVICE)
                read = per_expert * (tokens * k if tokens == 1 else len(torch.unique(ids[0])))
                with torch.no_grad():
                    if plain:
                        gated = _glu(expert_gemv(x, dense_up, ids[0]), inner)
                    else:
                        gated = expert_gemv(x, dense_up, ids[0], glu=True)
                    reference = expert_gemv_combine(gated, dense_down, ids[0], weights)
                    if tokens == 1 and plain:  # per token: gate/up, the activation, the down projection summed
                        row(f"expert_pair_gemv + combine ({shape})", fmt, tokens,
                            lambda i: expert_gemv_combine(
                                _glu(expert_pair_gemv(x, gate_up, ids[i]), inner), down, ids[i], weights),
                            draws, lambda: reference, read, lambda: expert_gemv_combine(
                                _glu(expert_pair_gemv(x, dense_up, ids[0]), inner), dense_down, ids[0],
                                weights))  # fmt: skip
                    elif tokens == 1:  # per token: SwiGLU, then the down projection with the weighted sum
                        row(f"expert_swiglu_gemv + combine ({shape})", fmt, tokens,
                            lambda i: expert_gemv_combine(
                                expert_swiglu_gemv(x, gate_up, ids[i]), down, ids[i], weights),
                            draws, lambda: reference, read, lambda: expert_gemv_combine(
                                expert_swiglu_gemv(x, dense_up, ids[0]), dense_down, ids[0], weights))  # fmt: skip
                    else:  # per expert: gate/up with SwiGLU, down
                        row(f"expert_gemv glu + down ({shape})", fmt, tokens,
                            lambda i: expert_gemv(expert_gemv(x, gate_up, ids[i], glu=True), down, ids[i].view(-1, 1)),
                            draws, lambda: expert_gemv(gated, dense_down, ids[0].view(-1, 1)), read,
                            lambda: expert_gemv(expert_gemv(x, dense_up, ids[0], glu=True), dense_down,
                                                ids[0].view(-1, 1)))  # fmt: skip


def _glu(gate_up: torch.Tensor, inner: int) -> torch.Tensor:
    """silu(gate) * up of gate/up rows [N, 2 inner] (the bench's stand-in for gpt-oss's activation)."""
    return (torch.nn.functional.silu(gate_up[:, :inner]) * gate_up[:, inner:]).contiguous()


def launch_rows() -> None:
    """--launches: what a call costs the host (µs, tiny operands, 2,000 calls queued and then one
    sync), for the ops a training step in batch-invariant mode launches in place of the default
    path's: a step of a few thousand tokens is bound by its host."""
    from moemesh.ops import invariant
    from moemesh.ops.rms_norm import rms_norm

    x = torch.randn(16, 64, dtype=DTYPE, device=DEVICE)
    w, bank = torch.randn(64, 64, dtype=DTYPE, device=DEVICE), torch.randn(4, 64, 64, dtype=DTYPE, device=DEVICE)
    sizes = torch.tensor([4, 4, 4, 4], device=DEVICE)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ops = {
        "F.linear (cuBLAS)": lambda: F.linear(x, w),
        "invariant.matmul (Triton)": lambda: invariant.matmul(x, w),
        "F.linear, autograd": lambda: F.linear(xg, wg),
        "invariant.linear, autograd": lambda: invariant.linear(xg, wg),
        "invariant._Matmul.apply, autograd": lambda: invariant._Matmul.apply(xg, wg),
        "F.linear in a Function, autograd": lambda: _LinearFunction.apply(xg, wg),
        "invariant.linear, no_grad": lambda: no_grad_linear(xg, wg),
        "grouped_mm (torch)": lambda: grouped_mm(x, bank, sizes),
        "invariant.grouped_matmul (Triton)": lambda: invariant.grouped_matmul(x, bank, sizes),
        "rms_norm (Triton)": lambda: rms_norm(x, w[0], 1e-6),
        "torch.add": lambda: x + x,
    }
    report(f"{'host µs a call':<40}{'µs':>8}")
    calls = 50 if SMOKE else 2000
    for name, op in ops.items():
        for _ in range(3):
            op()
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            op()
        host = time.perf_counter() - start
        sync()
        report(f"{name:<40}{host / calls * 1e6:>8.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    only = parser.add_mutually_exclusive_group()
    for flag, what in (
        ("--invariant-tiles", "batch-invariant matmul tiles"),
        ("--expert-tiles", "decoding's per-expert kernel's tiles"),
        ("--launches", "what a launch costs the host"),
        ("--invariant-attention", "batch-invariant attention's tiles"),
        ("--gemv-tiles", "decoding's projections (ops/gemv.py)"),
        ("--selected-tiles", "batch-invariant decode's experts"),
        ("--dequantize-tiles", "a quantized bank's dequantization (LoRA on a quantized base)"),
        ("--quantized-gemv", "decoding's GEMV kernels on FP8/MXFP4 weights against bf16"),
        ("--grid-barrier", "a dependent launch against a grid barrier"),
    ):
        only.add_argument(flag, action="store_true", help=f"only: {what}")
    parser.add_argument("--picked-tiles", action="store_true", help="with --invariant-tiles: only the picked ones")
    parser.add_argument(
        "--tile-formats", default="bf16,tp,fp8,mxfp4", help="with --expert-tiles: the banks (tp: bf16 TP slices)"
    )
    add_record_flag(parser)
    args = parser.parse_args()
    if not SMOKE and not torch.cuda.is_available():
        sys.exit("bench/kernels/ops.py needs a CUDA GPU (or --smoke for a CPU dry run)")
    torch.manual_seed(0)
    smoke = " (CPU smoke run: timings meaningless)" if SMOKE else ""
    report(f"moemesh kernel benchmark on {describe_device(DEVICE)}{smoke}")
    for only, rows in (
        (args.invariant_tiles, invariant_tile_rows),
        (args.launches, launch_rows),
        (args.grid_barrier, grid_barrier_rows),
        (args.invariant_attention, invariant_attention_rows),
    ):
        if only:
            rows()
            return 0
    copy_gbps = copy_bandwidth()
    for only, rows in (
        (args.expert_tiles, functools.partial(expert_tile_rows, formats=args.tile_formats.split(","))),
        (args.gemv_tiles, gemv_tile_rows),
        (args.selected_tiles, selected_tile_rows),
        (args.dequantize_tiles, dequantize_tile_rows),
        (args.quantized_gemv, quantized_gemv_rows),
    ):
        if only:
            rows(copy_gbps)
            return 0
    report(f"device copy bandwidth (dst.copy_(src), {SIZES['copy_bytes'] / 2**20:.0f} MiB): {copy_gbps:.0f} GB/s")
    report()
    bandwidth_rows(copy_gbps)
    report()
    expert_gemv_rows(copy_gbps)
    report()
    linear_cross_entropy_rows()
    report()
    all_ok = correctness_rows()
    report("(the whole MoE layer against transformers: bench/kernels/moe_layer.py)")
    if args.record:
        for figure in FIGURES:
            record(*figure)
    if OUT:
        with open(os.path.join(OUT, "kernels.txt"), "w") as f:
            f.write("\n".join(LINES) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    try:
        status = main()
    finally:
        if CACHE_DIR:
            shutil.rmtree(CACHE_DIR, ignore_errors=True)
    sys.exit(status)
