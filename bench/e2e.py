"""The whole training step — forward, backward, gradient clipping to norm 1 (as transformers' Trainer
does by default and `moemesh train` does), AdamW step, zero_grad — of moemesh against
transformers' own Qwen3-MoE, side by side in one run, on one GPU; and moemesh alone over two GPUs.

    PYTHONPATH=. python3 bench/e2e.py [--layers 6] [--seq 4096] [--batch 4] [--moemesh-fp32-master] [--recompute full]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/e2e.py --layout ep [--single-gpu-baseline TOKENS_PER_S]
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/e2e.py --layout dp_shard [--single-gpu-baseline TOKENS_PER_S]
    PYTHONPATH=. python3 bench/e2e.py --config configs/tiny.toml --seq 128 --batch 2 --steps 2 --warmup 1   (CPU smoke)

Model: Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8, expert width 768, 32/4 heads of 128,
vocabulary 151,936, untied embeddings) cut to --layers layers, or the [model] of a run config
(--config). Data: --batch random sequences of --seq tokens per GPU (fixed seed), labels = inputs.

Variants on one GPU (transformers first, each freed before the next so peaks are separate):
  transformers: bf16 weights and AdamW state, SDPA attention, grouped_mm experts where the version
                has that switch; loss from full logits plus the aux loss.
  moemesh:      bf16 weights and AdamW state, `build(..., dtype=bf16)`, fused linear cross-entropy.
  moemesh fp32-master (--moemesh-fp32-master): fp32 weights and AdamW state under
                torch.autocast(bf16), as `moemesh train` runs today.
  moemesh with activation checkpointing (--recompute full,selective): the bf16 row again, each
                decoder layer recomputed in backward (train.activation_checkpointing).
Two GPUs (torchrun, moemesh only, --batch sequences per GPU): ep=2 or dp_shard=2 (FSDP2: the shards
gathered before each block, gradients reduce-scattered), bf16 weights and AdamW state as on one
GPU (or fp32 weights under autocast, FSDP gathering them in bf16, with --moemesh-fp32-master), data
parallel over both ranks, loss = rank_loss(...), reduce_gradients, AdamW.

Reported: tokens/s (median step time of --steps after --warmup), MFU, peak memory (max allocated
after the first step, so weights, gradients and AdamW state are in it; max over ranks), final loss,
moemesh/transformers ratios; for moemesh the host synchronisations in one step (CUDA sync debug
mode) and a profiler summary of one step (top kernels, GEMM / NCCL / other shares of kernel time).

MFU = tokens/s × flops_per_token / (peak bf16 FLOP/s per GPU × GPUs), with flops_per_token (from
moemesh.train.flops) = 6 × active parameters excluding the embedding table (only top-k of each
expert bank counts; the LM head does) + 12 · layers · heads · head_dim · seq for attention scores
and values (forward + backward, no causal discount), counted on the whole model before EP splits it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import interval_length, median_ms, merged, print_table, profiled_kernels, qwen3_30b_a3b
from moemesh.config import load_config
from moemesh.models import ModelConfig, MoECausalLM, build
from moemesh.parallel.data import (
    apply_data_parallel,
    clip_grad_norm_,
    label_tokens,
    rank_loss,
    reduce_gradients,
)
from moemesh.parallel.expert import apply_ep
from moemesh.parallel.fsdp import apply_fsdp
from moemesh.parallel.mesh import ParallelDims, init_mesh
from moemesh.train.flops import flops_per_token, peak_flops

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
GEMM_PIECES = ("gemm", "cutlass", "sm90", "nvjet", "matmul", "grouped")


def model_config(args) -> ModelConfig:
    if args.config:
        overrides = [f"parallel.{args.layout}={WORLD}"] if WORLD > 1 else []
        config = load_config(args.config, overrides).model
    else:
        config = qwen3_30b_a3b(args.layers)
    return config.replace(max_position_embeddings=max(config.max_position_embeddings, args.seq))


def adamw(model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    # fused (one kernel for all parameters) on GPU; the foreach path elsewhere
    fused = device.type == "cuda"
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused, foreach=None if fused else True)


def transformers_model(config: ModelConfig, device: torch.device) -> tuple[torch.nn.Module, str]:
    import transformers

    hf = transformers.Qwen3MoeConfig(**config.to_hf_dict())
    hf._attn_implementation = "sdpa"
    try:  # transformers 5 can swap the experts' implementation
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if "grouped_mm" in ALL_EXPERTS_FUNCTIONS:
            hf._experts_implementation = "grouped_mm"
    except ImportError:
        pass
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialise in bf16 directly: no fp32 copy of the weights
    try:
        with torch.device(device):
            model = transformers.Qwen3MoeForCausalLM(hf)
    finally:
        torch.set_default_dtype(previous)
    model.to(torch.bfloat16).train()
    # what the model actually runs with (it may fall back at construction)
    experts = getattr(model.config, "_experts_implementation", None) or "default (no switch in this version)"
    return (
        model,
        f"transformers {transformers.__version__} (attn {model.config._attn_implementation}, experts {experts})",
    )


def kernel_summary(step, trace: Path | None = None) -> tuple[list[dict], dict[str, float]]:
    """Profile one step: the top 10 kernels by total time, and the shares of kernel time in GEMMs,
    NCCL and the rest (summed kernel durations, overlaps counted twice), and of the step's span
    in which no kernel ran ("GPU idle"). `trace`: also keep the step's Chrome trace (gzipped)."""
    kernels = profiled_kernels(step, trace)
    total, count = collections.Counter(), collections.Counter()
    for e in kernels:
        total[e["name"]] += e["dur"]
        count[e["name"]] += 1
    all_us = sum(total.values()) or 1.0
    shares = collections.Counter()
    for name, us in total.items():
        low = name.lower()
        kind = "NCCL" if "nccl" in low else "GEMM" if any(p in low for p in GEMM_PIECES) else "other"
        shares[kind] += us / all_us
    top = [
        {
            "kernel": (name[:90] + "…") if len(name) > 90 else name,
            "calls": count[name],
            "ms": f"{us / 1e3:.2f}",
            "share": f"{us / all_us:.1%}",
        }
        for name, us in total.most_common(10)
    ]
    busy = merged([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    shares["GPU idle"] = 1 - interval_length(busy) / (busy[-1][1] - busy[0][0]) if busy else 0.0
    return top, {k: shares[k] for k in ("GEMM", "NCCL", "other", "GPU idle")}


def count_syncs(step) -> int:
    """Host synchronisations in one step, as CUDA's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # the mode warns from one place: do not let the filter dedupe it
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def run_variant(name: str, model, forward, args, config: ModelConfig, device, flops: float, extra: dict) -> dict:
    """Time forward + backward + (reduce) + AdamW + zero_grad; `forward(ids) -> loss` gives this
    rank's loss on its local batch."""
    optimizer = adamw(model, device)
    generator = torch.Generator().manual_seed(1234)
    batch = torch.randint(config.vocab_size, (args.batch * WORLD, args.seq), generator=generator)
    local = batch[RANK * args.batch : (RANK + 1) * args.batch]  # each rank its own sequences
    ids = local.to(device)
    losses = []

    def step():
        loss = forward(ids, local, batch)
        loss.backward()
        if extra.get("moemesh"):
            reduce_gradients(model, extra["mesh"])
            clip_grad_norm_(model, 1.0, extra["mesh"])
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())  # no .item() here: that would sync inside the step

    on_gpu = device.type == "cuda"
    step()  # the first step allocates the AdamW state: it belongs in the peak, setup before it does not
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, warmup=max(args.warmup - 1, 0), repeat=args.steps)
    tokens_per_s = args.batch * WORLD * args.seq / ms * 1e3
    peak = peak_flops(device)
    loss = losses[-1].float()
    if WORLD > 1:  # each rank holds its share of the loss: the sum is the global one
        dist.all_reduce(loss)
    row = {
        "variant": name,
        "step ms": f"{ms:.0f}",
        "tokens/s": f"{tokens_per_s:,.0f}",
        "tokens/s/GPU": f"{tokens_per_s / WORLD:,.0f}",
        "MFU": f"{tokens_per_s * flops / (peak * WORLD):.1%}" if peak else "n/a",
        "peak GiB": "n/a",
        "loss": f"{loss.item():.4f}",
        "syncs/step": "n/a",
        "_tps": tokens_per_s,
        "_peak": None,
    }
    if on_gpu:
        peak_gib = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
        if WORLD > 1:
            dist.all_reduce(peak_gib, op=dist.ReduceOp.MAX)
        row["peak GiB"], row["_peak"] = f"{peak_gib.item():.1f}", peak_gib.item()
        if extra.get("moemesh"):
            row["syncs/step"] = str(count_syncs(step))
            if extra.get("profile"):
                trace = None
                if args.trace_dir:
                    layout = f"{args.layout}{WORLD}" if WORLD > 1 else "1gpu"
                    trace = Path(args.trace_dir) / f"e2e_{layout}_rank{RANK}.json.gz"
                row["_profile"] = kernel_summary(step, trace)
    return row


def moemesh_forward(model, config: ModelConfig, autocast: bool, mesh=None):
    device_type = next(model.parameters()).device.type
    ranks = mesh.dims.batch_size if mesh is not None else 1

    def forward(ids, local, batch):
        with torch.autocast(device_type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            out = model(ids, labels=ids, return_logits=False)
        if mesh is None:
            return out.loss  # ce + coef · aux
        # label counts from the host copies: no device sync
        return rank_loss(
            out.ce_loss, out.aux_loss, label_tokens(local), label_tokens(batch), config.router_aux_loss_coef, ranks
        )

    return forward


def free() -> None:
    """Release what the caller just deleted, so that the next variant's peak is its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--config", help="take the model from this run config (configs/tiny.toml: a CPU smoke run)")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--moemesh-fp32-master",
        action="store_true",
        help="add a row (one GPU) or use (ep) fp32 weights and AdamW state under bf16 autocast",
    )
    parser.add_argument("--layout", choices=["ep", "dp_shard"], default="ep", help="the two-GPU layout (torchrun)")
    parser.add_argument("--trace-dir", help="keep each rank's Chrome trace of the profiled step here (gzipped)")
    parser.add_argument(
        "--no-reshard",
        action="store_true",
        help="dp_shard: keep each block's gathered weights from forward to backward (one all-gather per step)",
    )
    parser.add_argument("--single-gpu-baseline", type=float, help="moemesh tokens/s on one GPU: print the scaling")
    parser.add_argument(
        "--recompute", default="", help="one GPU: moemesh rows with these activation checkpointing modes too (full,...)"
    )
    args = parser.parse_args()
    args.recompute = [mode for mode in args.recompute.split(",") if mode]
    torch.backends.cuda.matmul.allow_tf32 = True  # only the fp32 leftovers; GEMMs run in bf16
    config = model_config(args)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    # The model's arithmetic, the same for both implementations; on a meta-device moemesh model of
    # the whole config (before EP drops experts), which allocates nothing.
    with torch.device("meta"):
        flops = flops_per_token(MoECausalLM(config), args.seq)
    rows = []
    if WORLD == 1:
        model, title = transformers_model(config, device)
        rows.append(
            run_variant(
                title,
                model,
                lambda ids, local, batch: model(input_ids=ids, labels=ids).loss,
                args,
                config,
                device,
                flops,
                {},
            )
        )
        del model
        free()
        variants = [("moemesh (bf16)", torch.bfloat16, False, "none")]
        variants += [(f"moemesh (bf16, {mode} recompute)", torch.bfloat16, False, mode) for mode in args.recompute]
        if args.moemesh_fp32_master:
            variants.append(("moemesh (fp32 master, bf16 autocast)", None, True, "none"))
        for name, dtype, autocast, recompute in variants:
            model = build(config, seed=args.seed, device=device, dtype=dtype)
            model.activation_checkpointing = recompute
            rows.append(
                run_variant(
                    name,
                    model,
                    moemesh_forward(model, config, autocast),
                    args,
                    config,
                    device,
                    flops,
                    {"moemesh": True, "profile": len(rows) == 1, "mesh": init_mesh(ParallelDims())},
                )
            )
            del model
            free()
    else:
        mesh = init_mesh(ParallelDims(**{args.layout: WORLD}))
        fp32 = args.moemesh_fp32_master  # fp32 weights (FSDP: fp32 shards gathered in bf16) under autocast
        model = build(config, seed=args.seed, device=device, dtype=None if fp32 else torch.bfloat16)
        apply_data_parallel(apply_ep(model, mesh), mesh)
        apply_fsdp(model, mesh, param_dtype=torch.bfloat16, reshard_after_forward=not args.no_reshard)  # dp_shard only
        keep = ", gathered weights kept for backward" if args.no_reshard and args.layout == "dp_shard" else ""
        name = f"moemesh {args.layout}={WORLD} ({'fp32 master, bf16 autocast' if fp32 else 'bf16'}{keep})"
        rows.append(
            run_variant(
                name,
                model,
                moemesh_forward(model, config, fp32, mesh),
                args,
                config,
                device,
                flops,
                {"moemesh": True, "profile": True, "mesh": mesh},
            )
        )
        if args.single_gpu_baseline:
            rows[0]["scaling"] = f"{rows[0]['_tps'] / (args.single_gpu_baseline * WORLD):.0%} of {WORLD}× 1 GPU"

    if RANK == 0:
        base = rows[0]
        for row in rows:
            if WORLD == 1:
                row["tokens/s vs transformers"] = f"{row['_tps'] / base['_tps']:.2f}x"
                row["memory vs transformers"] = f"{row['_peak'] / base['_peak']:.2f}x" if base["_peak"] else "n/a"
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        model = args.config or f"{args.layers}-layer Qwen3-30B-A3B shape"
        print(
            f"device: {WORLD}× {gpu}, torch {torch.__version__}; model: {model}, "
            f"{args.batch}×{args.seq} tokens per GPU, {flops / 1e9:.3g} GFLOP per token"
        )
        profiles = [(row["variant"], row.pop("_profile")) for row in rows if "_profile" in row]
        print_table(
            [{k: v for k, v in row.items() if not k.startswith("_")} for row in rows],
            f"Training step (forward, backward, clipping, AdamW), {WORLD} {'GPU' if WORLD == 1 else 'GPUs'}",
        )
        for variant, (top, shares) in profiles:
            print_table(
                top,
                f"Top kernels of one step, {variant} (rank 0): GEMM {shares['GEMM']:.0%}, "
                f"NCCL {shares['NCCL']:.0%}, other {shares['other']:.0%} of kernel time; "
                f"GPU idle {shares['GPU idle']:.0%} of the step",
            )
        if not profiles:
            print("\nprofiler summary: n/a (no GPU)")
    if WORLD > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
