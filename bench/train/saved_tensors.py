"""What one decoder layer and the head save for backward on this device, tensor by tensor, against
the analytical estimate of `moemesh/parallel/pipeline/memory.py` (which the pipeline's memory
estimate is built from):

    PYTHONPATH=. python3 bench/train/saved_tensors.py [--config configs/gpu_small.toml] [--micro 4] [--seq 2048]

The model runs as the trainer runs it (fp32 weights under bf16 autocast on a GPU). Each saved
storage is listed once with its shape, dtype, MiB and the moemesh source line that saved it.
"""

from __future__ import annotations

import argparse
import collections
import traceback

import torch

from moemesh.config import load_config
from moemesh.models import build
from moemesh.parallel.pipeline.memory import estimate_layers, profile_layers


def saved_by_line(forward, parameters: set[int]) -> list[tuple[str, tuple, torch.dtype, int]]:
    """(moemesh source line, shape, dtype, bytes) of each storage `forward()` saves, parameters excluded."""
    seen, rows = set(), []

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.data_ptr() not in parameters:
            seen.add(storage.data_ptr())
            frames = [f for f in traceback.extract_stack()[:-1] if "/moemesh/" in f.filename]
            where = f"{frames[-1].filename.split('/moemesh/')[-1]}:{frames[-1].lineno}" if frames else "?"
            rows.append((where, tuple(t.shape), t.dtype, storage.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/gpu_small.toml")
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layer", type=int, default=1)
    args = parser.parse_args()
    config = load_config(args.config).model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(config, seed=0, device=device)
    ids = torch.randint(config.vocab_size, (args.micro, args.seq), device=device)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    positions = torch.arange(args.seq, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with autocast:
        h = model.run_layers(model.model.embed_tokens(ids), positions, range(args.layer))[0].detach().requires_grad_()
        items = {
            f"layer {args.layer}": lambda: model.run_layers(h, positions, [args.layer]),
            "head": lambda: model.head(model.model.norm(h), ids, return_logits=False),
        }
        for name, forward in items.items():
            rows = saved_by_line(forward, parameters)
            print(f"\n## {name}: {sum(r[3] for r in rows) / 2**20:.1f} MiB saved")
            by_line = collections.defaultdict(list)
            for where, shape, dtype, nbytes in rows:
                by_line[where].append((shape, dtype, nbytes))
            for where, tensors in sorted(by_line.items(), key=lambda kv: -sum(t[2] for t in kv[1])):
                listing = ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d, _ in tensors[:4])
                more = f" (+{len(tensors) - 4})" if len(tensors) > 4 else ""
                print(f"  {sum(t[2] for t in tensors) / 2**20:8.1f} MiB  {where:<34} {listing}{more}")
        profiles = profile_layers(model, ids, ids)
    dtype_bytes = 2 if device.type == "cuda" else 4
    estimate = estimate_layers(config, args.micro * args.seq, dtype_bytes, args.seq)
    print(f"\n## activations per item, measured ({device.type}) vs analytical")
    for profile, (name, _, activations, _) in zip(profiles, estimate):
        print(
            f"  {name:<10} measured {profile.activation_bytes / 2**20:9.1f} MiB"
            f"  analytical {activations / 2**20:9.1f} MiB"
            f"  ratio {profile.activation_bytes / max(activations, 1):.3f}"
        )


if __name__ == "__main__":
    main()
