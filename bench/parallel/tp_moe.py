"""One Qwen3-30B-A3B-shaped MoE block (H=2048, E=128, top-8, I=768, 16,384 tokens, bf16) under
tensor parallelism (experts split on I), forward + backward, with the partial expert outputs
reduced at one of two places:

    delayed    moemesh: routing-weight multiply and top-k sum run on the partial outputs, then
               one all-reduce of [T, H] per block
    per-slot   an all-reduce of the [T·k, H] expert outputs before the routing-weight multiply
               (k times the bytes; built here only, by moving the block's reduce)

    PYTHONPATH=. torchrun --nproc-per-node 2 bench/parallel/tp_moe.py [--tokens 16384]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/parallel/tp_moe.py --smoke    (tiny sizes; CPU/gloo too)

Prints on rank 0 the time and the bytes each rank all-reduces (counted by moemesh.parallel.comm)
per variant, beside the unsharded block on one device, and each variant's output, input gradient
and router gradient against that one-device block (both bf16: they differ by rounding only,
within TOLERANCE). Exits 1 beyond it.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

from bench.harness import describe_device, median_ms, print_table, rel_err
from moemesh.models import ModelConfig, build
from moemesh.models.moe import MoEBlock
from moemesh.parallel import comm
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp

SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
SMOKE_SHAPE = dict(hidden_size=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operation); summing the two ranks'
# partial outputs in another order than one device does moves the results by a few 1e-3.
TOLERANCE = 1e-2


def reduce_per_slot(block: MoEBlock, group) -> None:
    """Move the block's reduce from after combine to the expert outputs, one row per token slot.
    The routing weights then multiply whole outputs, so their gradient is whole as well: the f on
    them (the router's forward hook that apply_tp added) goes."""
    block.reduce_output = lambda out: out
    block.gate._forward_hooks.clear()
    block.experts.register_forward_hook(lambda module, args, out: comm.from_partial(out, group))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script (on CPU with gloo)")
    args = parser.parse_args()
    shape, tokens = (SMOKE_SHAPE, 64) if args.smoke else (SHAPE, args.tokens)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = init_mesh(ParallelDims(tp=world))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    # A one-layer model, so that apply_tp shards its block by the family plan, with its checks.
    config = ModelConfig(
        **shape, norm_topk_prob=True, num_hidden_layers=1, vocab_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    full = build(config, seed=0, device=device)
    one_device = copy.deepcopy(full.model.layers[0].mlp).bfloat16()
    delayed = apply_tp(copy.deepcopy(full), mesh).model.layers[0].mlp.bfloat16()
    per_slot = apply_tp(full, mesh).model.layers[0].mlp.bfloat16()
    reduce_per_slot(per_slot, mesh.group("tp"))

    generator = torch.Generator(device).manual_seed(1)  # the same tokens on every rank
    x = torch.randn(tokens, config.hidden_size, device=device, generator=generator).bfloat16().requires_grad_()
    grad = torch.randn(tokens, config.hidden_size, device=device, generator=generator).bfloat16()

    def step(block):
        block.zero_grad(set_to_none=True)
        x.grad = None
        out = block(x)[0]
        out.backward(grad)
        return out.detach(), x.grad, block.gate.weight.grad  # the router's gradient is the easy one to get wrong

    reference = step(one_device)
    rows, failed = [], False
    for name, block in [
        ("one device, unsharded", one_device),
        ("TP: delayed all-reduce (moemesh)", delayed),
        ("TP: per-slot all-reduce", per_slot),
    ]:
        comm.reset_counts()
        errors = [rel_err(ours, theirs) for ours, theirs in zip(step(block), reference)]
        failed |= max(errors) > TOLERANCE
        sent = {phase: comm.sent_bytes[("all_reduce", phase)] for phase in ("forward", "backward")}
        ms = median_ms(lambda block=block: step(block), repeat=20)
        rows.append(
            dict(
                variant=name,
                fwd_bwd_ms=f"{ms:.2f}",
                all_reduce_fwd=_size(sent["forward"]),
                all_reduce_bwd=_size(sent["backward"]),
                rel_err_out_dx_drouter=" / ".join(f"{e:.1e}" for e in errors),
                ms=ms,
            )
        )
    if mesh.rank("tp") == 0:
        for row in rows:
            row["vs_per_slot"] = f"{rows[2]['ms'] / row.pop('ms'):.2f}x"
        print(
            f"device: {world}× {describe_device(device)}; tokens {tokens}, H={config.hidden_size}, "
            f"E={config.num_experts}, top-{config.num_experts_per_tok}, I={config.moe_intermediate_size}"
        )
        print_table(rows, f"MoE block forward+backward under TP={world} (bf16)")
        print(f"TP vs the one-device block: {'FAIL' if failed else 'ok'} (tolerance {TOLERANCE})")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
