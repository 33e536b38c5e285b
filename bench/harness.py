"""The benchmark scripts' shared harness: timing and memory helpers (timing also on CPU, for smoke
runs), the description of the device and versions their headers print, their tables, the models
they build, and the results file: `record` writes a figure to docs/benchmarks/results.csv (a row
a figure, the file holding the current ones; git keeps their history), `add_record_flag` gives a
script its `--record`."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gc
import gzip
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from moemesh.config import load_config
from moemesh.models import ModelConfig

ROOT = Path(__file__).resolve().parent.parent  # the checkout
WORLD = int(os.environ.get("WORLD_SIZE", "1"))  # the processes torchrun launched (1 without it)
RANK = int(os.environ.get("RANK", "0"))


def qwen3_30b_a3b(layers: int) -> ModelConfig:
    """Qwen3-30B-A3B's shape (configs/qwen3_30b_a3b_6l.toml) cut to `layers` decoder layers."""
    path = ROOT / "configs" / "qwen3_30b_a3b_6l.toml"
    return ModelConfig(**tomllib.loads(path.read_text())["model"]).replace(num_hidden_layers=layers)


def add_model_arguments(parser, layers: int) -> None:
    """The two options `bench_model_config` reads: --layers of Qwen3-30B-A3B's shape, or --config."""
    parser.add_argument("--layers", type=int, default=layers, help="decoder layers of the Qwen3-30B-A3B shape")
    parser.add_argument("--config", help="this run config's model instead (configs/tiny.toml: CPU)")


def bench_model_config(args) -> ModelConfig:
    """The model of a bench's `--config` (a run config), else Qwen3-30B-A3B's shape of `--layers`."""
    return load_config(args.config, launched=False).model if args.config else qwen3_30b_a3b(args.layers)


def model_at(args) -> dict:
    """A bench's model as the keys of a results row's `at` (docs/benchmarks/results.csv): layers=N
    for the Qwen3-30B-A3B shape cut to --layers (configs/qwen3_30b_a3b.toml and _6l.toml too),
    model=NAME for another (--config's name, --hf's directory)."""
    if getattr(args, "hf", None):
        return {"model": Path(args.hf).name.lower()}
    if getattr(args, "config", None):
        stem = Path(args.config).stem
        if stem == "qwen3_30b_a3b":
            return {"layers": 48}
        if cut := re.fullmatch(r"qwen3_30b_a3b_(\d+)l", stem):
            return {"layers": int(cut[1])}
        return {"model": stem.replace("_", "-")}
    return {"layers": args.layers}


def moemesh_model(config: ModelConfig, device: torch.device, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """moemesh's model of `config` from seed 0 on `device`, for inference (eval), built in `dtype`
    directly (default bf16 on a GPU, fp32 on a CPU): the 48-layer model has no room for an fp32 copy."""
    if dtype is None:
        dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    from moemesh.models import build

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build(config, seed=0, device=device).eval()
    finally:
        torch.set_default_dtype(previous)


def grouped_mm_experts(hf_config) -> str:
    """Set a transformers config's experts to its `grouped_mm` implementation where the version
    has that switch (transformers 5); returns the implementation the config names."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
            hf_config._experts_implementation = "grouped_mm"
    except ImportError:
        pass
    return getattr(hf_config, "_experts_implementation", None) or "default (no switch in this version)"


def transformers_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.nn.Module, str]:
    """transformers' own Qwen3-MoE of `config`'s shape (the benches' peer), random weights made in
    `dtype` on `device`, SDPA attention, grouped_mm experts where the version has them, in train
    mode; and its title: the version and what the model runs with (it may fall back at construction)."""
    import transformers

    hf = transformers.Qwen3MoeConfig(**config.to_hf_dict())
    hf._attn_implementation = "sdpa"
    grouped_mm_experts(hf)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in bf16 directly: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(hf)
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype).train()
    experts = getattr(model.config, "_experts_implementation", None) or "default (no switch in this version)"
    return (
        model,
        f"transformers {transformers.__version__} (attn {model.config._attn_implementation}, experts {experts})",
    )


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
    taking nearly every token (bench/serve/routing_coverage.py), where a trained model's balanced router
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


def free() -> None:
    """Release what the caller just deleted (a model, an engine), so that the next variant's peak
    memory is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    """`rows` as a Markdown table under `## title`: every row's columns, in the order first seen,
    but those whose names start with "_" (a row's numbers kept for `record`)."""
    print(f"\n## {title}")
    columns = [c for c in dict.fromkeys(c for row in rows for c in row) if not c.startswith("_")]
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)) + " |")


# ---- the device, the versions --------------------------------------------------------------------


def device_name(device: torch.device | str | None = None) -> str:
    """The GPU's name (of `device`, default the current one), or on a CPU its model."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU " + line.partition(":")[2].strip()
    except OSError:
        pass
    return f"CPU {platform.processor() or platform.machine()}"


def versions() -> str:
    """torch's, triton's and transformers' versions (as installed: none imported for it)."""
    found = [f"torch {torch.__version__}"]
    for package in ("triton", "transformers"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"no {package}")
    return ", ".join(found)


def describe_device(device: torch.device | str | None = None) -> str:
    """The device and the versions, as the scripts' headers print them."""
    return f"{device_name(device)}; {versions()}"


def results_device(gpus: int | None = None) -> str:
    """The device of a results row: "4x NVIDIA H200" (`gpus`, default the processes torchrun
    launched), or on a CPU its cores and model."""
    if torch.cuda.is_available():
        return f"{gpus or WORLD}x {device_name()}"
    return f"{os.cpu_count()}-core {device_name()}"


# ---- the results file -----------------------------------------------------------------------------

RESULTS = ROOT / "docs" / "benchmarks" / "results.csv"  # $MOEMESH_RESULTS instead, where set
RESULTS_HEADER = ["figure", "at", "value", "unit", "peer", "peer_value", "device", "command", "date", "commit"]
_KEY = ("figure", "at", "peer", "device")  # a row of the same key is replaced


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--record",
        action="store_true",
        help="write this run's headline figures to docs/benchmarks/results.csv ($MOEMESH_RESULTS), each replacing "
        "the row of the same figure, x value, peer and device",
    )


def command_line() -> str:
    """The command that runs this process, as someone would type it again: `python3 bench/...` and
    its arguments, or `torchrun --nproc-per-node N bench/...` under torchrun."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    launcher = ["torchrun", "--nproc-per-node", str(WORLD)] if WORLD > 1 else ["python3"]
    return shlex.join([*launcher, str(script), *sys.argv[1:]])


def _commit() -> str:
    """The checkout's commit, "-dirty" after it where tracked files differ from it (the results file
    aside): a figure of uncommitted code names no commit that holds that code."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{RESULTS.relative_to(ROOT)}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    if done.returncode != 0 or not done.stdout.strip():
        return "unknown"
    return done.stdout.strip() + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def _cell(value) -> str:
    """A number as the results file writes it: whole from 1,000 on, else 4 significant digits."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def at_keys(**keys) -> str:
    """A results row's `at`: key=value pairs joined by ";", in the keys' order ("batch=64;layers=48");
    those of None left out."""
    return ";".join(f"{key}={value}" for key, value in sorted(keys.items()) if value is not None)


def record(
    figure: str,
    at: str | dict,
    value: float,
    unit: str,
    peer: str = "",
    peer_value: float | None = None,
    command: str | None = None,
    *,
    gpus: int | None = None,
) -> dict | None:
    """Write a figure to the results file ($MOEMESH_RESULTS, default docs/benchmarks/results.csv,
    made with its header if missing): `figure` a stable name ("decode ms/token"), `at` where it was
    measured as key=value pairs joined by ";" ("batch=64;layers=48"; a dict: `at_keys`'), `value` in
    `unit`, beside `peer` (its name, "transformers") and `peer_value`; the device (`results_device`
    of `gpus`), `command` (default this process's, `command_line`), today's date (UTC) and the
    checkout's commit. A row of the same figure, at, peer and device is replaced where it stands.
    Only rank 0 writes; returns the row (None on the other ranks). A peer without its value (or a
    value without its peer) is a ValueError."""
    if bool(peer) != (peer_value is not None):
        raise ValueError(f"{figure} at {at}: a peer ({peer!r}) goes with its value ({peer_value!r}), and only with it")
    if RANK != 0:
        return None
    if isinstance(at, dict):
        at = at_keys(**at)
    path = Path(os.environ.get("MOEMESH_RESULTS") or RESULTS)
    row = {
        "figure": figure,
        "at": at,
        "value": _cell(value),
        "unit": unit,
        "peer": peer,
        "peer_value": _cell(peer_value),
        "device": results_device(gpus),
        "command": command_line() if command is None else command,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
    }
    rows = []
    if path.is_file():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != RESULTS_HEADER:
                raise SystemExit(f"{path}: its header is {reader.fieldnames}, not {RESULTS_HEADER}")
            rows = list(reader)
    key = [row[k] for k in _KEY]
    at_row = next((i for i, old in enumerate(rows) if [old[k] for k in _KEY] == key), None)
    if at_row is None:
        rows.append(row)
    else:
        rows[at_row] = row
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(path.name + ".tmp")
    with written.open("w", newline="") as f:
        writer = csv.DictWriter(f, RESULTS_HEADER, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    written.replace(path)
    return row


# ---- a script's modes -----------------------------------------------------------------------------


def chosen_mode(argv: list[str], modes: dict[str, str]) -> str | None:
    """Which of `modes` (option -> help) `argv` names: a script whose modes each have options of
    their own parses its arguments with the chosen mode's parser. None: no mode named."""
    named = [mode for mode in modes if any(a == mode or a.startswith(mode + "=") for a in argv)]
    if len(named) > 1:
        raise SystemExit(f"{' and '.join(named)}: one mode at a time")
    return named[0] if named else None


def add_modes(parser: argparse.ArgumentParser, modes: dict[str, str]) -> None:
    """`modes` in `parser`, as switches, but those the chosen mode's options hold already (a mode
    whose option takes a value): which runs is `chosen_mode`'s, from the same words."""
    group = parser.add_argument_group("modes", "one at a time, each with options of its own (MODE --help lists them)")
    for mode, text in modes.items():
        if mode not in parser._option_string_actions:
            group.add_argument(mode, action="store_true", help=text)


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


def kernels_by_name(kernels: list[dict], width: int | None = 70) -> list[tuple[str, float, int]]:
    """Profiled kernels (`profiled_kernels`) grouped by their names' first `width` characters (None:
    whole names): (name, µs in all, calls), the busiest first."""
    total, calls = Counter(), Counter()
    for kernel in kernels:
        total[kernel["name"][:width]] += kernel["dur"]
        calls[kernel["name"][:width]] += 1
    return [(name, us, calls[name]) for name, us in total.most_common()]


def busy_intervals(kernels: list[dict]) -> list[tuple[float, float]]:
    """The merged [start, end) intervals (µs) in which any of the profiled `kernels` ran."""
    return merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])


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


def chat_rows(sequences: int, seq: int, mean: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Chat rows filling `sequences` sequences of `seq` tokens, in order, as `data/packing.py` packs
    them: (token ids, mask of the tokens trained) a row, lengths uniform in [mean/4, 7 mean/4] (the
    last of a sequence cut to fit), tokens uniform over `vocab`, the second half of each row trained
    (an assistant's reply after its prompt). The same rows for the same arguments; `packed_rows`
    puts them back in their sequences."""
    generator = torch.Generator().manual_seed(seed)
    lengths = []
    for _ in range(sequences):
        at = 0
        while at < seq:
            lengths.append(min(seq - at, int(torch.randint(mean // 4, 7 * mean // 4 + 1, (1,), generator=generator))))
            at += lengths[-1]
    tokens = torch.randint(vocab, (sequences * seq,), generator=generator).split(lengths)
    return [(ids, torch.arange(len(ids)) >= len(ids) // 2) for ids in tokens]


def packed_rows(rows: list[tuple[torch.Tensor, torch.Tensor]], seq: int) -> tuple[torch.Tensor, ...]:
    """`chat_rows`' rows in their sequences: token ids, positions (restarting at 0 for each row) and
    the trained mask, each [sequences, seq]."""
    ids = torch.cat([ids for ids, _ in rows]).view(-1, seq)
    positions = torch.cat([torch.arange(len(ids)) for ids, _ in rows]).view(-1, seq)
    trained = torch.cat([trained for _, trained in rows]).view(-1, seq)
    return ids, positions, trained
