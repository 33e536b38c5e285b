"""Expert-parallel dispatch + combine against a raw `all_to_all_single` of the same bytes.

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/parallel/ep_alltoall.py [--tokens 16384]

Qwen3-30B-A3B-shaped routing (H=2048, E=128, top-8, bf16), tokens per rank as given. Times the
dispatch (split-size exchange, token all-to-all, local expansion) and the combine (weighted
reduce, all-to-all back, sum per token) with no expert compute in between, counts the bytes each
rank sends through moemesh.parallel.comm, and compares the achieved rate with a plain
`all_to_all_single` moving the same number of bytes in equal splits.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from bench.harness import describe_device, median_ms, print_table
from moemesh.models import ModelConfig
from moemesh.models.moe import Router
from moemesh.parallel import comm
from moemesh.parallel.expert import AllToAllDispatcher
from moemesh.parallel.mesh import ParallelDims, init_mesh


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = init_mesh(ParallelDims(ep=world))
    rank, group = mesh.rank("ep"), mesh.group("ep")
    device = torch.device("cuda", torch.cuda.current_device())
    config = ModelConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    torch.manual_seed(rank)
    router = Router(config).to(device)
    torch.nn.init.normal_(router.weight, std=0.02)
    x = torch.randn(args.tokens, config.hidden_size, device=device, dtype=torch.bfloat16)
    routing = router(x.float())
    dispatcher = AllToAllDispatcher(group, world, config.num_experts // world)

    def dispatch_combine():
        dispatched = dispatcher.dispatch(x, routing, config.num_experts)
        return dispatcher.combine(dispatched.grouped, dispatched, routing, args.tokens)

    comm.reset_counts()
    dispatch_combine()
    sent = sum(n for (kind, _), n in comm.sent_bytes.items() if kind == "all_to_all")
    ms = median_ms(dispatch_combine, warmup=3, repeat=20)

    # the same bytes per rank through one raw all_to_all_single, equal splits
    raw_in = torch.empty(sent // world * world, dtype=torch.uint8, device=device)
    raw_out = torch.empty_like(raw_in)
    raw_ms = median_ms(lambda: dist.all_to_all_single(raw_out, raw_in, group=group), warmup=3, repeat=20)

    if rank == 0:
        rows = [
            dict(
                path="moemesh dispatch+combine",
                bytes_sent_per_rank=f"{sent / 2**20:.1f} MiB",
                ms=f"{ms:.3f}",
                GB_per_s=f"{sent / ms / 1e6:.1f}",
                vs_raw=f"{raw_ms / ms:.2f}x",
            ),
            dict(
                path="raw all_to_all_single",
                bytes_sent_per_rank=f"{raw_in.numel() / 2**20:.1f} MiB",
                ms=f"{raw_ms:.3f}",
                GB_per_s=f"{raw_in.numel() / raw_ms / 1e6:.1f}",
                vs_raw="1.00x",
            ),
        ]
        print(f"device: {world}× {describe_device(device)}; tokens/rank {args.tokens}")
        print_table(rows, "EP dispatch + combine vs raw all-to-all (bf16, H=2048, E=128, top-8)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
