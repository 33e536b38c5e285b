"""Setting a model up on one GPU, and loading one for generation (issue 18):

    PYTHONPATH=. python3 bench/serve/model_load.py [--layers 6,48] [--cut auto|N] [--dir /tmp/moemesh-cut]
    PYTHONPATH=. python3 bench/serve/model_load.py --device cpu --config configs/tiny.toml --layers 2 --cut 2 \\
        (a dry run)

1. Build from the seed, bf16, on the GPU: the Qwen3-30B-A3B shape cut to each of `--layers`. moemesh
   makes the model on the meta device and initialises each tensor where it lives
   (`models/build.py`); beside it, the way moemesh built before (every parameter drawn whole from
   its own CPU generator, then copied), on the 6-layer shape. Then the whole `Trainer` setup of
   configs/qwen3_30b_a3b_6l.toml (data, model, optimizer).
2. Load for generation: the largest cut of the 48-layer shape that fits the disk (or `--cut N`
   layers) is written as a bf16 Hugging Face directory of random weights (per-expert tensors, 5 GB
   shards, as the hub's), then `load_for_generation` reads it onto the GPU: seconds and GB/s, the
   host's peak resident memory (VmHWM, reset first) against the model's bytes, and the GPU's peak
   against the weights. The page cache is dropped first where the machine allows it (said in the
   output), so the files come from the disk.

With `--hand-over N` instead (issue 50): a training run's weights into an engine in place, the
N-layer shape — two models on the GPU (the policy being trained and the engine's), the engine made
over the second, then `engine.load_weights(policy)`: seconds (best of 3) and GB/s of weights.
With `--ipc` also from another process on the same GPU: a spawned process builds the policy and
sends it three times (`models/weights.send_weights`: CUDA IPC handles, no copy on the way); this
one's engine takes it (`receive_weights(connection, engine.load_weights)`, timed from the sender's
go to the reply: the sender's sharing, the receiver's mapping, the copy, the synchronisation).
The rows run one after the other, so the GPU holds two models at a time.

    PYTHONPATH=. python3 bench/serve/model_load.py --hand-over 48 [--ipc]
    PYTHONPATH=. python3 bench/serve/model_load.py --device cpu --config configs/tiny.toml --hand-over 2 --ipc \\
        (a dry run)
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import zlib
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.harness import ROOT, device_name, drop_page_cache, free, print_table, qwen3_30b_a3b, timed
from moemesh.checkpoint.hf import write_pretrained
from moemesh.config import load_config
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.generate import load_for_generation
from moemesh.models.build import meta_model
from moemesh.models.weights import receive_weights, send_weights
from moemesh.parallel.parallelize import materialize
from moemesh.train.trainer import Trainer

CONFIG = ROOT / "configs" / "qwen3_30b_a3b_6l.toml"
DEVICE = "cuda"


def resident(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def build_whole_on_cpu_generators(config, seed: int = 0) -> torch.nn.Module:
    """How moemesh built before: each parameter drawn whole from its own CPU generator, then copied."""
    model = meta_model(config, torch.bfloat16)
    model.to_empty(device=DEVICE)
    with torch.no_grad():
        for name, param in model.named_parameters():
            generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
            param.copy_(torch.empty(param.shape).normal_(0.0, 0.02, generator=generator))
    return model


def build_rows(layers: list[int]) -> list[dict]:
    rows = []
    for n in layers:
        config = qwen3_30b_a3b(n)
        seconds, model = timed(lambda: materialize(meta_model(config, torch.bfloat16), DEVICE, seed=0))
        params = model.num_params()
        rows.append(
            {
                "what": f"build from the seed, {n} layers ({params / 1e9:.1f}B parameters, bf16)",
                "moemesh s": f"{seconds:.2f}",
                "before s": "",
            }
        )
        del model
        free()
        if n == min(layers):
            before, model = timed(lambda: build_whole_on_cpu_generators(config))
            rows[-1]["before s"] = f"{before:.2f}"
            rows[-1]["ratio"] = f"{before / seconds:.1f}x"
            del model
            free()
    trainer_config = load_config(CONFIG, [f"train.device={DEVICE}"])
    seconds, trainer = timed(lambda: Trainer(trainer_config, stream=open(os.devnull, "w")))
    rows.append(
        {
            "what": f"Trainer setup, {CONFIG.name} (data, model, optimizer)",
            "moemesh s": f"{seconds:.2f}",
            "before s": "",
        }
    )
    del trainer
    free()
    return rows


def cut_layers(directory: Path, requested: str) -> int:
    if requested != "auto":
        return int(requested)
    full, one = qwen3_30b_a3b(48), qwen3_30b_a3b(1)
    per_layer = (meta_model(qwen3_30b_a3b(2)).num_params() - meta_model(one).num_params()) * 2
    fixed = meta_model(one).num_params() * 2 - per_layer
    free = shutil.disk_usage(directory.parent).free
    return min(full.num_hidden_layers, int((free * 0.9 - fixed) // per_layer))


def write_cut(directory: Path, layers: int) -> int:
    config = qwen3_30b_a3b(layers)
    shapes = meta_model(config, torch.bfloat16).state_dict()
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    tensors = (
        (name, (torch.randn(t.shape, generator=generator, device=DEVICE, dtype=torch.bfloat16) * 0.02))
        for name, t in shapes.items()
    )
    shutil.rmtree(directory, ignore_errors=True)
    write_pretrained(tensors, config, directory)
    return sum(t.numel() * 2 for t in shapes.values())


def load_row(directory: Path, layers: int, model_bytes: int) -> dict:
    dropped = drop_page_cache()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")
    host_before = resident("VmRSS")
    seconds, (model, _) = timed(lambda: load_for_generation(directory, device=DEVICE, dtype=torch.bfloat16))
    host_peak = resident("VmHWM") - host_before
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gpu_peak = torch.cuda.max_memory_allocated() / weights if DEVICE == "cuda" else float("nan")
    return {
        "what": f"load for generation, {layers} layers, {model_bytes / 1e9:.1f} GB bf16 "
        f"({'cold: page cache dropped' if dropped else 'page cache not droppable: warm'})",
        "moemesh s": f"{seconds:.1f}",
        "GB/s": f"{model_bytes / seconds / 1e9:.2f}",
        "host peak / model": f"{host_peak / model_bytes:.1%}",
        "GPU peak / weights": f"{gpu_peak:.3f}",
    }


def hand_over_setup(layers: int) -> tuple:
    config = load_config(CONFIG, launched=False).model.replace(num_hidden_layers=layers)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    engine = DecodeEngine(
        materialize(meta_model(config, dtype), DEVICE, seed=1).eval(), max_batch=1, max_len=64, num_blocks=8
    )
    return config, dtype, engine


def checksum(model: torch.nn.Module) -> float:
    return sum(t.float().sum().item() for t in model.state_dict().values())


def hand_over_row(layers: int) -> dict:
    """Two bf16 models of the shape on the device, an engine over the second; the first's weights
    into it, timed."""
    config, dtype, engine = hand_over_setup(layers)
    policy = materialize(meta_model(config, dtype), DEVICE, seed=0)
    seconds = min(timed(lambda: engine.load_weights(policy))[0] for _ in range(3))
    assert torch.equal(engine.model.lm_head.weight, policy.lm_head.weight)
    weights = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    return {
        "what": f"a training run's weights into an engine in place ({layers} layers, load_weights)",
        "s": f"{seconds:.3f}",
        "GB/s": f"{weights / seconds / 1e9:,.0f}",
        "weights GB": f"{weights / 1e9:.1f}",
    }


def send_policy(connection, config, dtype, device: str, times: int) -> None:
    """In the spawned process: build the policy, say so (its checksum), then send it `times` times,
    each at the receiver's go."""
    policy = materialize(meta_model(config, dtype), device, seed=0)
    connection.send(checksum(policy))
    for _ in range(times):
        connection.recv()
        send_weights(connection, policy, timeout=600)


def ipc_hand_over_row(layers: int, times: int = 3) -> dict:
    """The engine here, the policy in a spawned process on the same device: its weights over a
    pipe (CUDA IPC handles; shared memory on CPU), timed from the go to the reply."""
    config, dtype, engine = hand_over_setup(layers)
    context = mp.get_context("spawn")
    mine, theirs = context.Pipe()
    sender = context.Process(target=send_policy, args=(theirs, config, dtype, DEVICE, times), daemon=True)
    sender.start()
    theirs.close()
    try:
        assert mine.poll(600), "the sending process built no policy in 10 minutes"
        expected, seconds = mine.recv(), []
        for _ in range(times):
            start = time.perf_counter()
            mine.send("go")
            count = receive_weights(mine, engine.load_weights, timeout=600)
            seconds.append(time.perf_counter() - start)
        sender.join(60)
        assert sender.exitcode == 0, f"the sending process exited with {sender.exitcode}"
    finally:
        if sender.is_alive():
            sender.kill()
    assert count == len(engine.model.state_dict()) and checksum(engine.model) == expected
    weights = sum(t.numel() * t.element_size() for t in engine.model.state_dict().values())
    return {
        "what": f"the same from another process, over {'CUDA IPC' if DEVICE == 'cuda' else 'shared memory'} "
        f"({layers} layers, send_weights / receive_weights)",
        "s": f"{min(seconds):.3f}",
        "GB/s": f"{weights / min(seconds) / 1e9:,.0f}",
        "weights GB": f"{weights / 1e9:.1f}",
    }


def main() -> None:
    global DEVICE, CONFIG
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="6,48", help="shapes to build from the seed")
    parser.add_argument("--cut", default="auto", help="layers of the directory to load (auto: what the disk holds)")
    parser.add_argument("--dir", default="/tmp/moemesh-cut")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", default=str(CONFIG), help="the shape (its layer count is replaced)")
    parser.add_argument("--hand-over", type=int, metavar="N", help="only: weights into an engine, N layers")
    parser.add_argument("--ipc", action="store_true", help="with --hand-over: also from another process")
    args = parser.parse_args()
    DEVICE, CONFIG = args.device, Path(args.config)
    name = device_name(DEVICE)
    if args.hand_over:
        rows = [hand_over_row(args.hand_over)]
        free()
        if args.ipc:
            rows.append(ipc_hand_over_row(args.hand_over))
        return print_table(rows, f"hand-over on {name}")
    rows = [] if args.skip_build else build_rows([int(n) for n in args.layers.split(",")])
    print_table(rows, f"setup on {name}")
    directory = Path(args.dir)
    layers = cut_layers(directory, args.cut)
    start = time.perf_counter()
    model_bytes = write_cut(directory, layers)
    print(f"wrote {layers} layers ({model_bytes / 1e9:.1f} GB) in {time.perf_counter() - start:.0f} s", flush=True)
    rows.append(load_row(directory, layers, model_bytes))
    print_table(rows, f"setup and loading on {name}")
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
