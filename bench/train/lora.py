"""LoRA fine-tuning steps of moemesh beside transformers + PEFT, on the same shapes, in one run on
one GPU (issue 30), and on packed chat rows beside TRL's SFTTrainer + PEFT on the same rows (issue
74): step time, tokens/s, MFU, peak memory, trainable parameters.

    PYTHONPATH=. python3 bench/train/lora.py [--layers 48] [--seq 4096] [--batch 1] [--rank 16 --alpha 32]
    PYTHONPATH=. python3 bench/train/lora.py --hf /models/Qwen3-30B-A3B          (read a real directory)
    PYTHONPATH=. python3 bench/train/lora.py --config configs/tiny.toml --seq 64 --steps 2 --warmup 1   (CPU smoke)
    PYTHONPATH=. python3 bench/train/lora.py --packed 512 --trl [--skip-peft]     (beside TRL on chat rows)
        TRL 1.16 from wheels downloaded into .whl (git-ignored; datasets also needs xxhash, where missing):
        python3 -m pip install --no-index --find-links .whl trl datasets dill multiprocess
    PYTHONPATH=. python3 bench/train/lora.py --count-ops [N] [--config configs/tiny.toml --seq 256]
        (CPU: kernels a layer)

Model: Qwen3-30B-A3B's shape (hidden 2048, 128 experts top-8, expert width 768, 32/4 heads of
128, vocabulary 151,936) cut to --layers layers, with random weights built on the GPU (the device
has no network, and 61 GB of bf16 weights need not go through the disk); or the model of a
Hugging Face directory (--hf), which both sides read; or the [model] of a run config (--config).
Data: --batch random sequences of --seq tokens (fixed seed), labels = inputs. --packed N: chat rows
(bench/harness.py's `chat_rows`: lengths uniform in [N/4, 7N/4], random tokens, the second half of
each row trained, a fixed seed) filling --batch × (max(--warmup, 1) + --steps) sequences of --seq
tokens: every moemesh variant also trains on the first --batch of them, packed as drawn (positions
restarting at each row, attention within it, labels -100 where untrained), the same each step;
TRL (--trl) on all of them, one step's worth a step.

Each side, for each adapter set (--targets: attention + every expert's two banks, and attention
only), in bf16 with the base frozen, adapters fp32 (PEFT's default upcast; moemesh's
train.param_dtype), AdamW (fused on a GPU) on the adapters, clipping to norm 1:
  transformers + PEFT  SDPA attention, grouped_mm experts, gradient checkpointing (non-reentrant);
                       adapters on q/k/v/o (target_modules) and on the fused expert banks
                       (target_parameters: PEFT's ParamWrapper, peft >= 0.17)
  moemesh              `apply_lora` (rank-r grouped GEMMs inside the experts' path), activation
                       checkpointing --recompute (full and/or selective), fused linear
                       cross-entropy, bf16 autocast
  TRL SFTTrainer       (--trl) TRL's own loop over the chat rows as a pre-tokenized prompt-completion
   + PEFT              dataset (input_ids, completion_mask), completion_only_loss, packing on
                       (packing_strategy "bfd": padding-free, per_device_train_batch_size --batch,
                       max_length --seq); the transformers model and PEFT adapters (peft_config)
                       of the transformers + PEFT rows; gradient checkpointing (non-reentrant),
                       bf16 mixed precision and optim adamw_torch_fused on a GPU, lr 1e-4,
                       max_grad_norm 1, router_aux_loss_coef 0 (cross-entropy alone, as the other
                       rows; TRL's default takes the config's and turns router logits on), no
                       logging, saving or evaluation, dataloader defaults. TRL's own loss: its
                       fused chunked LM head (the trained positions' log-probabilities alone).
Each variant is freed before the next, so that each peak is its own (max allocated after the first
step: the AdamW state is in it; with --cuda-graph, max reserved: the graph's pool is held
whole). MFU = tokens/s × FLOPs per token / peak bf16 FLOP/s, FLOPs per token from
moemesh.train.flops: 4 per frozen active parameter (forward, input gradient), 6 per trained one,
attention's scores and values; recomputation is not counted (the usual convention). --record: for
each adapter set the fastest moemesh row's tokens/s and peak memory, beside transformers + PEFT's,
to the results file (bench/harness.py's `record`); each packed row's tokens/s beside its variant's
on raw text; with --trl, the fastest bf16 packed row's tokens/s and peak memory beside TRL's (peer
"trl sft+peft", at packed=N).

TRL's steps: max_steps max(--warmup, 1) + --steps, each optimizer step timed by a TrainerCallback
(the GPU synchronized at the step's begin and end: the batch's loading and collation fall outside),
the median of those after the warm-up; tokens/s the median over those steps of the step's tokens
(counted as the collator receives its packed sequences: padding-free, no padding) by its time;
BFD fills a sequence with up to --seq tokens, moemesh's carry --seq exactly. Peak memory: max
allocated after the first step, as for the other rows; the loss shown is the run's mean.
Attention: with packing "bfd", TRL (1.16) turns padding-free on and warns of nothing about the
attention implementation (its SFTConfig says padding-free is for FlashAttention 2/3): each step's
--batch packed sequences become one row of up to batch × seq tokens with position_ids restarting
at each chat row (and cu_seq_lens, which only the varlen flash kernels read), no attention mask.
With SDPA, transformers (masking_utils, 5.17 as 5.24) finds the rows from position_ids'
restarts when no mask and no cache are given (find_packed_sequence_indices) and builds a boolean
block-causal mask [1, 1, T, T]: each row attends within itself alone, so the numbers are right,
but with a mask SDPA takes neither its flash kernel (the memory-efficient one reads the mask) nor
enable_gqa (the 4 key/value heads repeated to 32). That is what a TRL user on SDPA runs; this
script changes none of it.

--count-ops (CPU, no GPU needed): the kernels that one decoder layer of moemesh's LoRA step
launches, forward and backward (the recomputation inside), per recompute mode: a proxy for the
GPU's, since the step is bound by the host's launches. Counted as on a GPU: bf16 base, fp32
adapters, bf16 autocast, one grouped GEMM per expert bank (not the CPU's loop over experts), and
moemesh's Triton kernels (RMSNorm, SwiGLU, permute, combine) run by Triton's CPU interpreter, one
launch each (the script restarts itself with TRITON_INTERPRET=1 and MOEMESH_KERNELS=triton; without
Triton their references' ops are counted instead). Each aten op that computes counts once; views,
aliases and allocations launch nothing and are left out. A layer's count is that of a model with
two layers less that of one with one. The list of the most called ops shows where they go.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import os
import statistics
import sys
import tempfile
import time
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import (
    add_record_flag,
    chat_rows,
    describe_device,
    free,
    grouped_mm_experts,
    median_ms,
    model_at,
    packed_rows,
    print_table,
    qwen3_30b_a3b,
    record,
    sync,
    transformers_model,
)
from moemesh.config import load_config
from moemesh.models import ModelConfig
from moemesh.models.build import init_weights, meta_model
from moemesh.models.lora import LoraConfig, apply_lora, is_adapter
from moemesh.ops.backend import HAVE_TRITON, INTERPRETED
from moemesh.train.cuda_graph import CapturedStep
from moemesh.train.flops import flops_per_token, peak_flops

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {"attention+experts": True, "attention": False}  # name -> LoRA on the expert banks too


def model_config(args) -> ModelConfig:
    if args.hf:
        from moemesh.checkpoint.load import read_model_config

        config = read_model_config(args.hf)
    elif args.config:
        config = load_config(args.config).model
    elif args.shape != "qwen3_30b_a3b":
        config = load_config(f"configs/{args.shape}.toml", launched=False).model
        config = config.replace(num_hidden_layers=args.layers or config.num_hidden_layers)
    else:
        config = qwen3_30b_a3b(args.layers)
    return config.replace(max_position_embeddings=max(config.max_position_embeddings, args.seq))


# ---- transformers + PEFT -----------------------------------------------------------------------


def hf_model(config: ModelConfig, args, device, dtype):
    """transformers' model, SDPA attention, grouped_mm experts: the --hf directory's, else random
    weights of `config`'s shape (`transformers_model`)."""
    import transformers

    if not args.hf:
        return transformers_model(config, device, dtype)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.hf, dtype=dtype, device_map=device, attn_implementation="sdpa"
    )
    grouped_mm_experts(model.config)
    return model


def lora_config(args, experts: bool):
    """PEFT's adapters: q/k/v/o (target_modules), and the fused expert banks where `experts`
    (target_parameters: PEFT's ParamWrapper, peft >= 0.17)."""
    import peft

    banks = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if experts else []
    return peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=ATTENTION, target_parameters=banks)


def peft_model(config: ModelConfig, args, experts: bool, device, dtype):
    import peft
    import transformers

    model = hf_model(config, args, device, dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, lora_config(args, experts))
    model.train()
    version = f"transformers {transformers.__version__} + peft {peft.__version__}"
    return model, version, lambda ids: model(input_ids=ids, labels=ids).loss


# ---- TRL's SFTTrainer + PEFT -----------------------------------------------------------------------


def trl_variant(targets: str, chat: list, args, config: ModelConfig, device, dtype) -> dict:
    """TRL's SFTTrainer + PEFT trained on `chat` (`chat_rows`) as its user trains it: the rows as a
    pre-tokenized prompt-completion dataset (input_ids, completion_mask), packed by TRL (BFD,
    padding-free), the transformers model and PEFT's adapters of the transformers + PEFT rows. Each
    optimizer step timed by a callback; its tokens counted as the collator batches them."""
    import datasets
    import peft
    import transformers
    import trl

    class Steps(transformers.TrainerCallback):
        """Each step's milliseconds (the GPU synchronized at its begin and end) and the tokens of its
        batch; the peak memory counted from the end of the first step (the AdamW state is in it)."""

        def __init__(self):
            self.ms, self.tokens = [], []

        def counting(self, collator):
            def collate(examples):
                self.tokens.append(sum(len(example["input_ids"]) for example in examples))
                return collator(examples)

            return collate

        def on_step_begin(self, *_, **__):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **_):
            sync()
            self.ms.append((time.perf_counter() - self.start) * 1e3)
            if state.global_step == 1 and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)

    if device.type == "cuda":  # what earlier variants left behind would crowd TRL's allocations
        print(
            f"TRL starts with {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated, "
            f"{torch.cuda.memory_reserved(device) / 2**30:.1f} GiB reserved",
            file=sys.stderr,
        )
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [ids.tolist() for ids, _ in chat], "completion_mask": [m.int().tolist() for _, m in chat]}
    )
    warmup, cuda = max(args.warmup, 1), device.type == "cuda"
    steps = Steps()
    with tempfile.TemporaryDirectory() as out:  # nothing is written there
        training = trl.SFTConfig(
            output_dir=out,
            max_steps=warmup + args.steps,
            per_device_train_batch_size=args.batch,
            max_length=args.seq,
            packing=True,
            packing_strategy="bfd",
            completion_only_loss=True,
            router_aux_loss_coef=0.0,  # cross-entropy alone, as moemesh's rows train
            learning_rate=1e-4,
            max_grad_norm=1.0,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            bf16=cuda,
            gradient_checkpointing=True,
            gradient_checkpointing_kwargs={"use_reentrant": False},
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=args.seed,
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf) if args.hf else transformers.ByT5Tokenizer()
        trainer = trl.SFTTrainer(
            model=hf_model(config, args, device, dtype),
            args=training,
            train_dataset=dataset,
            processing_class=tokenizer,  # the rows are token ids already: TRL reads its pad token alone
            peft_config=lora_config(args, TARGETS[targets]),
            callbacks=[steps],
        )
        trainer.data_collator = steps.counting(trainer.data_collator)  # the same collator, its batches counted
        loss = trainer.train().training_loss
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    timed = list(zip(steps.ms, steps.tokens))[warmup:]
    row = variant_row(
        f"trl {trl.__version__} SFTTrainer + peft {peft.__version__} (packing bfd, padding-free)",
        targets,
        statistics.median(ms for ms, _ in timed),
        statistics.median(tokens / ms * 1e3 for ms, tokens in timed),
        trained,
        loss,
        args,
        config,
        device,
        # beside graphed moemesh rows (the graph's pool held whole: max reserved), TRL's max reserved too
        (torch.cuda.max_memory_reserved if args.cuda_graph == "on" else torch.cuda.max_memory_allocated)(device) / 2**30
        if cuda
        else None,
    )
    row["loss"] += " (mean)"
    del trainer, trained
    free()
    return row


# ---- moemesh -----------------------------------------------------------------------------------


def moemesh_model(
    config: ModelConfig, args, experts: bool, recompute: str, device, dtype, base: str = "bf16", packed=None
):
    """moemesh's LoRA model and its forward; `packed`: (positions, trained mask) of the chat rows
    packed into the sequences it is given (`packed_rows`: positions restarting, attention within
    each row, half trained)."""
    model = meta_model(config, dtype)  # the frozen base in the compute dtype
    adapters = LoraConfig(rank=args.rank, alpha=args.alpha, targets=ATTENTION, experts=experts)
    apply_lora(model, adapters, getattr(torch, args.adapter_dtype))
    model.activation_checkpointing = recompute
    if base != "bf16":
        random_quantized_base(model, base, device, args.seed)
    model.to_empty(device=device)
    model.tie_weights()
    if args.hf:
        from moemesh.checkpoint.load import load_weights

        load_weights(model, args.hf)
        init_weights(model, args.seed, only=is_adapter)
    else:
        init_weights(model, args.seed)
    model.train()
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else contextlib.nullcontext()
    )

    if packed is not None:
        positions, trained = (t.to(device) for t in packed)

    def forward(ids):
        with autocast:
            if packed is None:
                return model(ids, labels=ids, return_logits=False).loss
            return model(ids, labels=torch.where(trained, ids, -100), positions=positions, return_logits=False).loss

    return model, forward


@torch.no_grad()
def random_quantized_base(model, base: str, device, seed: int) -> None:
    """The frozen weights a published checkpoint of `base` quantizes (fp8: every projection and
    expert bank; mxfp4: the expert banks), as QuantizedWeights of random N(0, 0.02) weights made on
    the GPU, a few experts at a time (what `lora.keep_quantized` keeps from a checkpoint)."""
    from moemesh.checkpoint.quantized import quantize_fp8, quantize_mxfp4
    from moemesh.models.moe import EXPERT_BANKS, Experts
    from moemesh.ops.linear import Linear
    from moemesh.ops.quantized_weight import FP8_TILE, QuantizedWeight

    generator = torch.Generator(device).manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            banks = EXPERT_BANKS
        elif isinstance(module, Linear) and base == "fp8" and not name.endswith("lm_head"):
            banks = ("weight",)
        else:
            continue
        for bank in banks:
            param = getattr(module, bank)
            shape = param.shape if param.ndim == 3 else (1, *param.shape)
            codes, scales = [], []
            for first in range(0, shape[0], 8):
                w = torch.randn(min(8, shape[0] - first), *shape[1:], device=device, generator=generator) * 0.02
                if base == "fp8":
                    q, tiles = quantize_fp8(w)
                    codes.append(q)
                    scales.append(tiles.repeat_interleave(FP8_TILE, -2)[..., : shape[1], :].contiguous())
                else:
                    q, e8m0 = quantize_mxfp4(w)
                    codes.append(q)
                    scales.append(e8m0)
                del w
            codes, scales = torch.cat(codes), torch.cat(scales)
            if param.ndim == 2:
                codes, scales = codes[0], scales[0]
            del module._parameters[bank]
            setattr(module, bank, QuantizedWeight(base, codes, scales, param.dtype))


# ---- one variant ---------------------------------------------------------------------------------


def run_variant(
    name: str, targets: str, model, forward, ids, args, config: ModelConfig, device, graphed: bool = False
) -> dict:
    """`model`'s steps on `ids` ([batch, seq]), the same each step."""
    trained = [p for p in model.parameters() if p.requires_grad]
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=fused, foreach=None if fused else True)
    ids = ids.to(device)
    losses = []

    def forward_backward(ids):
        loss = forward(ids)
        loss.backward()
        return (loss.detach(),)

    if graphed:  # forward and backward one CUDA graph; clipping and AdamW eager, as the trainer runs them
        forward_backward = CapturedStep(forward_backward, [ids], trained)

    def step():
        (loss,) = forward_backward(ids)
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not graphed)
        losses.append(loss.clone())

    step()  # allocates the AdamW state: in the peak
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = median_ms(step, warmup=max(args.warmup - 1, 0), repeat=args.steps)
    if args.profile and device.type == "cuda":
        print_profile(name, targets, step, args.profile)
    peak = peak_gib(device, graphed) if device.type == "cuda" else None
    loss = losses[-1].float().item()
    return variant_row(name, targets, ms, ids.numel() / ms * 1e3, trained, loss, args, config, device, peak)


def variant_row(
    name: str, targets: str, ms: float, tokens_per_s: float, trained, loss: float, args, config, device, peak
) -> dict:
    """A row of the table: a variant's step time, tokens/s, MFU, peak memory (GiB, None: not
    measured), trainable parameters and loss."""
    with torch.device("meta"):  # the same FLOPs for both sides: a moemesh model with these adapters
        counted = meta_model(config)
        apply_lora(counted, LoraConfig(rank=args.rank, alpha=args.alpha, targets=ATTENTION, experts=TARGETS[targets]))
    flops = flops_per_token(counted, args.seq)
    flops_per_s = peak_flops(device)
    return {
        "implementation": name,
        "LoRA on": targets,
        "step ms": f"{ms:.0f}",
        "tokens/s": f"{tokens_per_s:,.0f}",
        "MFU": f"{tokens_per_s * flops / flops_per_s:.1%}" if flops_per_s else "n/a",
        "peak GiB": "n/a" if peak is None else f"{peak:.1f}",
        "trainable": f"{sum(p.numel() for p in trained) / 1e6:.1f}M",
        "loss": f"{loss:.4f}",
        "_tps": tokens_per_s,
        "_peak": peak,
    }


def peak_gib(device, graphed: bool) -> float:
    """Eager: the most allocated. A CUDA graph's pool is held whole between replays, its
    temporaries included, so a graphed step counts the most reserved."""
    peak = torch.cuda.max_memory_reserved(device) if graphed else torch.cuda.max_memory_allocated(device)
    return peak / 2**30


def print_profile(name: str, targets: str, step, top: int) -> None:
    """One step's GPU kernels, grouped by name: the `top` costliest, and how busy the GPU was."""
    from bench.harness import busy_intervals, interval_length, kernels_by_name, profiled_kernels, timed

    wall, kernels = timed(lambda: profiled_kernels(step))
    by_name = kernels_by_name(kernels, width=90)
    busy = interval_length(busy_intervals(kernels))
    total = sum(us for _, us, _ in by_name)
    rows = [{"kernel": n, "ms": f"{t / 1e3:.1f}", "share": f"{t / total:.1%}", "calls": c} for n, t, c in by_name[:top]]
    print_table(
        rows,
        f"{name}, LoRA on {targets}: one profiled step {wall * 1e3:.0f} ms wall, GPU busy {busy / 1e3:.0f} ms, "
        f"{len(kernels)} kernels",
    )


# ---- aten ops per layer (CPU) --------------------------------------------------------------------

_LAUNCH_NOTHING = {
    "empty",
    "empty_strided",
    "empty_like",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "promote_types",
    "new_empty",
    "new_empty_strided",
}


class OpCounter(TorchDispatchMode):
    """The aten ops dispatched inside it that compute, by phase and name (views, aliases and
    allocations left out), and the Triton kernels its interpreter runs (not the ops they run)."""

    def __init__(self):
        super().__init__()
        self.phase = "forward"
        self.counts: collections.Counter = collections.Counter()
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not (self.in_kernel or func.is_view or name in _LAUNCH_NOTHING):
            self.counts[self.phase, name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def triton_launches(self):
        if not INTERPRETED:
            yield
            return
        from triton.runtime.interpreter import GridExecutor

        launch = GridExecutor.__call__

        def counted(executor, *args, **kwargs):
            self.counts[self.phase, f"triton {executor.fn.__name__}"] += 1
            self.in_kernel = True
            try:
                return launch(executor, *args, **kwargs)
            finally:
                self.in_kernel = False

        with mock.patch.object(GridExecutor, "__call__", counted):
            yield


def count_step_ops(config: ModelConfig, args, experts: bool, recompute: str) -> collections.Counter:
    """(phase, op) -> calls in one LoRA training step's forward and backward (not the optimizer)."""
    model = meta_model(config, torch.bfloat16)
    apply_lora(model, LoraConfig(rank=args.rank, alpha=args.alpha, targets=ATTENTION, experts=experts), torch.float32)
    model.activation_checkpointing = recompute
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, args.seed)
    model.train()
    ids = torch.randint(config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1234))
    counter = OpCounter()
    # One grouped GEMM launch per bank, as on a GPU (the CPU path otherwise loops over experts).
    with (
        mock.patch("moemesh.ops.grouped_mm._use_kernel", lambda x: x.dtype == torch.bfloat16),
        counter.triton_launches(),
        counter,
    ):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids, labels=ids, return_logits=False).loss
        counter.phase = "backward"
        loss.backward()
    return counter.counts


def print_op_counts(config: ModelConfig, args) -> None:
    rows, detail = [], []
    for targets in args.targets.split(","):
        for recompute in ["none", *args.recompute.split(",")]:
            one, two = (
                count_step_ops(config.replace(num_hidden_layers=n), args, TARGETS[targets], recompute) for n in (1, 2)
            )
            layer = two - one
            phases = {phase: sum(c for (p, _), c in layer.items() if p == phase) for phase in ("forward", "backward")}
            rows.append(
                {"LoRA on": targets, "recompute": recompute, **phases, "forward + backward": sum(phases.values())}
            )
            if args.count_ops > 0:
                by_op = collections.Counter()
                for (_, op), c in layer.items():
                    by_op[op] += c
                detail.append((targets, recompute, by_op.most_common(args.count_ops)))
    kernels = "Triton's interpreter" if INTERPRETED else "their references (no Triton)"
    print(f"model: {args.config}; {args.batch}×{args.seq} tokens; LoRA r={args.rank}; moemesh's kernels: {kernels}")
    print_table(rows, "kernels a decoder layer launches in a LoRA training step (CPU, counted as a GPU launches them)")
    for targets, recompute, ops in detail:
        print_table([{"op": op, "calls": c} for op, c in ops], f"{targets}, {recompute} recompute: the most called ops")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's, 48 for Qwen3-30B-A3B)")
    parser.add_argument(
        "--shape",
        default="qwen3_30b_a3b",
        choices=["qwen3_30b_a3b", "gpt_oss_20b", "gpt_oss_120b"],
        help="the model's shape (gpt-oss: configs/gpt_oss_*.toml), random weights",
    )
    parser.add_argument(
        "--base",
        default="bf16",
        help="moemesh's frozen base, comma-separated: bf16, fp8 (block FP8), mxfp4 (the experts), kept quantized",
    )
    parser.add_argument("--hf", help="a Hugging Face directory to read the model from (both sides)")
    parser.add_argument("--config", help="take the model from this run config (configs/tiny.toml: a CPU smoke run)")
    parser.add_argument("--seq", type=int, help="tokens a sequence (default 4096; 256 with --count-ops)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of {', '.join(TARGETS)}")
    parser.add_argument(
        "--recompute",
        default="full,selective",
        help="moemesh's activation checkpointing modes to run (comma-separated; '': no moemesh rows)",
    )
    parser.add_argument(
        "--cuda-graph",
        choices=["off", "on", "both"],
        default="off",
        help="moemesh's forward and backward as one CUDA graph (train.cuda_graphs)",
    )
    parser.add_argument(
        "--adapter-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="moemesh's adapters and their AdamW state (train.param_dtype)",
    )
    parser.add_argument(
        "--packed", type=int, default=0, metavar="N", help="also each moemesh variant on chat rows of ~N tokens packed"
    )
    parser.add_argument(
        "--trl", action="store_true", help="also TRL's SFTTrainer + PEFT on the same chat rows (needs --packed)"
    )
    parser.add_argument("--skip-peft", action="store_true", help="moemesh alone (no transformers + PEFT rows)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, help="print the N costliest kernels of one step (GPU)")
    parser.add_argument(
        "--count-ops",
        type=int,
        nargs="?",
        const=0,
        default=None,
        metavar="N",
        help="count the aten ops a layer dispatches (CPU; with N, also list the N most called)",
    )
    add_record_flag(parser)
    args = parser.parse_args()
    args.seq = args.seq or (4096 if args.count_ops is None else 256)
    if args.trl and not args.packed:
        parser.error("--trl trains on chat rows: give --packed N")
    if args.shape == "qwen3_30b_a3b" and not (args.hf or args.config):
        args.layers = args.layers or 48
    if args.count_ops is not None:
        if HAVE_TRITON and not INTERPRETED:  # the interpreter is chosen at import: start again with it
            env = {**os.environ, "TRITON_INTERPRET": "1", "MOEMESH_KERNELS": "triton"}
            os.execve(sys.executable, [sys.executable, *sys.argv], env)
        args.config = args.config or "configs/tiny.toml"
        print_op_counts(model_config(args), args)
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = model_config(args)
    raw = torch.randint(config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1234))
    # --packed: the chat rows of TRL's steps (the untimed first one included); moemesh's are the first batch of them
    chat = []
    if args.packed:
        sequences = args.batch * (max(args.warmup, 1) + args.steps)
        chat = chat_rows(sequences, args.seq, args.packed, config.vocab_size, args.seed)
        ids, positions, trained = (t[: args.batch] for t in packed_rows(chat, args.seq))
    rows = []
    for targets in args.targets.split(","):
        experts = TARGETS[targets]
        if not args.skip_peft:
            model, version, forward = peft_model(config, args, experts, device, dtype)
            rows.append(run_variant(version, targets, model, forward, raw, args, config, device))
            rows[-1]["_peer"] = "transformers+peft"
            del model, forward
            free()
        for base in args.base.split(","):
            for recompute in [mode for mode in args.recompute.split(",") if mode]:
                for graphed, packed in itertools.product(
                    {"off": [False], "on": [True], "both": [False, True]}[args.cuda_graph],
                    [0, args.packed][: 1 + bool(args.packed)],
                ):
                    chat_mask = (positions, trained) if packed else None
                    model, forward = moemesh_model(config, args, experts, recompute, device, dtype, base, chat_mask)
                    how = f"{', CUDA graph' if graphed else ''}{f', chat rows of ~{packed} packed' if packed else ''}"
                    name = f"moemesh ({base} base, {recompute} recompute{how})"
                    tokens = ids if packed else raw
                    rows.append(run_variant(name, targets, model, forward, tokens, args, config, device, graphed))
                    rows[-1]["_base"], rows[-1]["_packed"] = base, packed
                    del model, forward
                    free()
        if args.trl:
            rows.append(trl_variant(targets, chat, args, config, device, dtype))
            rows[-1]["_peer"] = "trl sft+peft"
    for row in rows:
        if peft := peer_row(rows, row["LoRA on"], "transformers+peft"):
            row["tokens/s vs PEFT"] = f"{row['_tps'] / peft['_tps']:.2f}x"
        if (trl := peer_row(rows, row["LoRA on"], "trl sft+peft")) and row.get("_packed"):
            row["tokens/s vs TRL"] = f"{row['_tps'] / trl['_tps']:.2f}x"
    source = args.hf or args.config or f"{config.num_hidden_layers}-layer {args.shape} shape, random weights"
    print(
        f"device: {describe_device(device)}; model: {source}; {args.batch}×{args.seq} tokens per step; "
        f"LoRA r={args.rank} alpha={args.alpha:g}; base {str(dtype).removeprefix('torch.')}, frozen"
    )
    print_table(rows, "LoRA training step")
    if args.record:
        record_rows(args, rows)


def peer_row(rows: list[dict], targets: str, peer: str) -> dict | None:
    """The row of `peer` ("transformers+peft", "trl sft+peft": the results file's names) for an
    adapter set, where the run has one."""
    return next((r for r in rows if r["LoRA on"] == targets and r.get("_peer") == peer), None)


def record_rows(args, rows: list[dict]) -> None:
    """--record: for each adapter set and base, the fastest moemesh row's tokens/s and peak memory
    beside its peer of the same run: for the bf16 base transformers + PEFT's (not recorded
    without it), for a quantized base the bf16 base's fastest row, where the run has one. Packed
    rows (--packed): each beside moemesh's raw-text row of its variant; with --trl, the fastest
    of the bf16 base beside TRL's (tokens/s and peak memory)."""
    for targets in args.targets.split(","):
        peft, trl = peer_row(rows, targets, "transformers+peft"), peer_row(rows, targets, "trl sft+peft")
        best = {}
        for base in args.base.split(","):
            ours = [r for r in rows if r["LoRA on"] == targets and r.get("_base") == base and not r.get("_packed")]
            if ours:
                best[base] = max(ours, key=lambda r: r["_tps"])
            packed = [r for r in rows if r["LoRA on"] == targets and r.get("_base") == base and r.get("_packed")]
            for row in packed:
                name = row["implementation"].rsplit(", chat rows", 1)[0] + ")"  # its variant on raw text
                raw = next(r for r in rows if r["LoRA on"] == targets and r["implementation"] == name)
                at = {
                    **model_at(args),
                    "targets": targets,
                    "packed": row["_packed"],
                    **({"base": base} if base != "bf16" else {}),
                }
                record("lora tokens/s", at, row["_tps"], "tokens/s", "moemesh raw text", raw["_tps"])
            if base == "bf16" and packed and trl:
                row = max(packed, key=lambda r: r["_tps"])
                at = {**model_at(args), "targets": targets, "packed": row["_packed"]}
                record("lora tokens/s", at, row["_tps"], "tokens/s", "trl sft+peft", trl["_tps"])
                if row["_peak"] is not None:
                    record("lora peak memory GiB", at, row["_peak"], "GiB", "trl sft+peft", trl["_peak"])
        for base, row in best.items():
            peer, name = (peft, "transformers+peft") if base == "bf16" else (best.get("bf16"), "moemesh bf16 base")
            if base == "bf16" and peer is None:
                continue
            at = model_at(args) if args.shape == "qwen3_30b_a3b" or args.hf or args.config else {"model": args.shape}
            at = {**at, "targets": targets, **({"base": base} if base != "bf16" else {})}
            at = {**at, "tokens": args.batch * args.seq} if args.shape != "qwen3_30b_a3b" else at
            name = name if peer else ""
            record("lora tokens/s", at, row["_tps"], "tokens/s", name, peer and peer["_tps"])
            if row["_peak"] is not None:
                record("lora peak memory GiB", at, row["_peak"], "GiB", name, peer and peer["_peak"])


if __name__ == "__main__":
    main()
