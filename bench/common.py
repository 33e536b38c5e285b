"""Timing and memory helpers shared by the benchmark scripts (timing also on CPU, for smoke runs)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import statistics
import tempfile
import time
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from moemesh.config import load_config
from moemesh.models import ModelConfig


def qwen3_30b_a3b(layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's shape (configs/qwen3_30b_a3b_6l.toml) cut to `layers` decoder layers."""
    path = Path(__file__).resolve().parent.parent / "configs" / "qwen3_30b_a3b_6l.toml"
    return ModelConfig(**tomllib.loads(path.read_text())["model"]).replace(num_hidden_layers=layers)


def add_model_arguments(parser, layers: int) -> None:
    """The two options `bench_model_config` reads: --layers of Qwen3-30B-A3B's shape, or --config."""
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers of the Qwen3-30B-A3B shape")
    parser.add_argument("--config", help="this run config's model instead (configs/tiny.toml: CPU)")


def bench_model_config(args) -> ModelConfig:
    """The model of a bench's `--config` (a run config), else Qwen3-30B-A3B's shape of `--layers`."""
    return load_config(args.config, launched=False).model if args.config else qwen3_30b_a3b(args.layers)


def tensor_parallel_model(config: ModelConfig, layout: str = "tp"):
    """(this rank's shard of `config`'s model, its group) over all ranks torchrun launched, as
    `moemesh serve --tp N` (layout "tp"), `--ep N` ("ep") or `--tp N --ep N` ("tp-ep": tensor
    parallelism, the experts whole) lays it out: built on meta, laid out for N = WORLD_SIZE, each
    rank drawing its shard from seed 0 (bf16 on a GPU, fp32 on a CPU). One process: the whole
    model, no group."""
    from moemesh.models.build import meta_model
    from moemesh.parallel.config import ParallelConfig, StepShape
    from moemesh.parallel.expert import apply_ep_for_decoding
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.parallelize import materialize, parallelize
    from moemesh.parallel.tensor import apply_tp_whole_experts

    world = int(os.environ.get("WORLD_SIZE", "1"))
    axis = "ep" if layout == "ep" else "tp"
    mesh = init_mesh(ParallelDims(**{axis: world}))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    model = meta_model(config, torch.bfloat16 if on_gpu else torch.float32)
    if layout == "ep":
        apply_ep_for_decoding(model, mesh)
    elif layout == "tp-ep":
        apply_tp_whole_experts(model, mesh)
    else:
        parallelize(model, mesh, ParallelConfig(tp=world), StepShape(dtype="bfloat16" if on_gpu else "float32"))
    return materialize(model, device, seed=0).eval(), mesh.group(axis)


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers' routers (`mlp.gate` in every family), in layer order."""
    return [module for name, module in model.named_modules() if name.endswith("mlp.gate")]


def spread_routing(model: torch.nn.Module) -> None:
    """Make every router of `model` choose experts spread over all of them, as a trained router's
    choices are, in place of the random weights'.

    A random-weight model routes the tokens of one sequence to a few experts: in the 48-layer
    Qwen3-30B-A3B shape one prompt of 512 tokens touches 25 of 128 experts a layer, one expert
    taking nearly every token (bench/routing_coverage.py), where a trained model's balanced router
    spreads them over most experts. A prompt's grouped GEMMs read the weights of the experts it
    touches, so the random weights make one prompt's prefill several times cheaper than a
    served model's. Here each token's k experts are the top k of sin(10³ · x·P), P a fixed random
    [hidden, experts] fp32 matrix: a hash of the router's input, so the same token in the same context
    routes alike (the prefix cache and greedy outputs stay consistent), inside CUDA graphs too.
    The routing weights stay the router's own. Its cost: one fp32 [tokens, hidden] × [hidden,
    experts] product a layer more."""
    generator = torch.Generator().manual_seed(0)
    for module in routers(model):
        experts, hidden = module.weight.shape
        projection = torch.randn(hidden, experts, generator=generator).to(module.weight.device)

        def choose(router, args, routing, projection=projection):
            scores = torch.sin((args[0].float() @ projection) * 1e3)  # fp32: bf16 would merge near tokens
            ids = scores.topk(routing.expert_ids.shape[-1], dim=-1).indices.to(routing.expert_ids.dtype)
            return dataclasses.replace(routing, expert_ids=ids)

        module.register_forward_hook(choose)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call, the GPU's queued work included."""
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - start, out


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the kernel's page cache (root only): the next read comes from
    disk. False where that is not allowed."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """‖ours − reference‖ / ‖reference‖, computed in float64."""
    ours, reference = ours.double(), reference.double()
    return ((ours - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def median_ms(fn: Callable[[], object], warmup: int = 3, repeat: int = 10) -> float:
    """Median wall time of fn() in milliseconds, timed with CUDA events after warm-up (with the
    host clock where there is no GPU)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak CUDA memory fn() allocates above what was already allocated before it ran."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n## {title}")
    columns = list(dict.fromkeys(c for row in rows for c in row))  # every row's columns, in order
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)) + " |")


# ---- GPU timelines from the profiler -----------------------------------------------------------


def profiled_kernels(fn: Callable[[], object], trace: Path | None = None, host: bool = False) -> list[dict]:
    """Run fn() under the profiler; returns its GPU kernels as Chrome-trace events (name, ts and
    dur in µs). `trace`: also keep the whole trace there, gzipped; `host`: record the host's side
    in it too (operators, CUDA API calls)."""
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
        warnings.simplefilter("ignore", UserWarning)
        with torch.profiler.profile(activities=activities) as prof:
            fn()
            torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:  # the trace format is stable across versions
        prof.export_chrome_trace(f.name)
        text = Path(f.name).read_text()
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace, "wt") as out:
            out.write(text)
    return [e for e in json.loads(text)["traceEvents"] if e.get("cat") == "kernel"]


def kernel_intervals(
    fn: Callable[[], object], trace: Path | None = None
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Run fn() under the profiler; returns the merged [start, end) intervals (µs) of the NCCL
    kernels and of all other kernels. `trace`: also keep the Chrome trace there, host side included."""
    return split_intervals(profiled_kernels(fn, trace, host=trace is not None))


def split_intervals(kernels: list[dict]) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """The merged [start, end) intervals (µs) of the NCCL kernels and of all other kernels."""
    nccl = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()]
    other = [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    return merged(nccl), merged(other)


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def interval_length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def intersection_length(a, b) -> float:
    """Total length where two sorted, merged interval lists overlap."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total
