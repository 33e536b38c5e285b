"""One Qwen3-30B-A3B-shaped MoE layer (H=2048, E=128, top-8, I=768, 16,384 tokens, bf16), forward
+ backward: moemesh's MoEBlock against transformers' own Qwen3-MoE block (its `grouped_mm`
experts implementation where it has one), same weights, same input, in one process.

    PYTHONPATH=. python3 bench/kernels/moe_layer.py [--tokens 16384]

Prints time, peak memory above the weights and input, and each output's error against an fp32
evaluation of the same block; --record writes moemesh's time and peak memory beside transformers'
to the results file (bench/harness.py's `record`).
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from bench.harness import (
    add_record_flag,
    describe_device,
    grouped_mm_experts,
    median_ms,
    peak_bytes,
    print_table,
    record,
    rel_err,
)
from moemesh.models import ModelConfig
from moemesh.models.moe import MoEBlock

SHAPE = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True)


def transformers_block(device) -> tuple[torch.nn.Module, str]:
    config = transformers.Qwen3MoeConfig(**SHAPE)
    implementation = grouped_mm_experts(config)  # transformers >= 5 can swap the experts' implementation
    return Qwen3MoeSparseMoeBlock(config).to(device), implementation


def _output(result):
    return result[0] if isinstance(result, tuple) else result  # older versions also return router logits


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    add_record_flag(parser)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda")
    torch.manual_seed(0)

    theirs, implementation = transformers_block(device)
    ours = MoEBlock(ModelConfig(**SHAPE)).to(device)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.02)
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.gate_up_proj.copy_(theirs.experts.gate_up_proj)
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
    x32 = torch.randn(args.tokens, SHAPE["hidden_size"], device=device)
    grad32 = torch.randn_like(x32)

    # fp32 reference: our block's plain PyTorch path (checked against transformers on CPU by the tests)
    os.environ["MOEMESH_KERNELS"] = "torch"
    reference = ours(x32)[0].detach()
    theirs.bfloat16(), ours.bfloat16()
    x, grad = x32.bfloat16().requires_grad_(), grad32.bfloat16()

    variants = {
        f"transformers ({implementation})": ("auto", lambda: _output(theirs(x.view(1, *x.shape))).view_as(x)),
        "moemesh (plain PyTorch path)": ("torch", lambda: ours(x)[0]),
        "moemesh": ("auto", lambda: ours(x)[0]),
    }
    rows = []
    for name, (kernels, forward) in variants.items():
        os.environ["MOEMESH_KERNELS"] = kernels

        def step():
            for module in (theirs, ours):
                module.zero_grad(set_to_none=True)
            x.grad = None
            forward().backward(grad)

        error = rel_err(forward().detach(), reference)
        ms = median_ms(step)
        peak = peak_bytes(step)
        rows.append(
            dict(
                variant=name,
                fwd_bwd_ms=f"{ms:.2f}",
                peak_GiB=f"{peak / 2**30:.2f}",
                rel_err_vs_fp32=f"{error:.2e}",
                _ms=ms,
                _peak=peak,
            )
        )
    theirs = rows[0]
    for row in rows:
        row["speedup_vs_transformers"] = f"{theirs['_ms'] / row['_ms']:.2f}x"
        row["memory_vs_transformers"] = f"{row['_peak'] / theirs['_peak']:.2f}x"
    print(f"device: {describe_device(device)}; tokens {args.tokens}")
    print_table(rows, "MoE layer forward+backward (bf16)")
    if args.record:  # moemesh as shipped beside transformers
        ours, at = rows[-1], {"tokens": args.tokens}
        record("moe layer ms", at, ours["_ms"], "ms", "transformers", theirs["_ms"])
        record("moe layer peak memory GiB", at, ours["_peak"] / 2**30, "GiB", "transformers", theirs["_peak"] / 2**30)


if __name__ == "__main__":
    main()
