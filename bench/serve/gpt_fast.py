"""gpt-fast's own MoE model (pytorch-labs/gpt-fast, `mixtral-moe/`) as a decoding peer, at our shape.

    PYTHONPATH=. python3 bench/serve/decode.py --layers 48 --batches 1 --no-transformers --prompt-len 128 \\
        --variants 1 --quantize fp8 --gpt-fast PATH/TO/gpt-fast

gpt-fast is not a package: give the directory of a checkout (its `mixtral-moe/model.py`,
`quantize.py` and `generate.py` are imported from there, as its own scripts import them). Its
model is built at the shape of ours with random N(0, 0.02) weights on the GPU, and its decode
step is run as its `generate.py` runs it: `decode_one_token` compiled with
`mode="reduce-overhead", fullgraph=True`, its inductor settings, the math attention backend, its
sampling (temperature 0.8, top-k 200, as its defaults). Twice: in bf16, and in its int8
weight-only variant (`WeightOnlyBit8QuantHandler`: per-channel int8 weights, bf16 scales, the
router kept in bf16). A row gives a step's ms at batch 1, timed after --new-tokens // 4 warm
steps (the compilation and the graph's capture left out).

Where the shape differs: gpt-fast's attention makes its query as wide as the hidden size (heads ×
head_dim = dim), so Qwen3-30B-A3B's 32 heads of 128 over a hidden size of 2,048 become 16 heads of
128 — its q and o projections half of ours, 0.8 GB less a token to read, in its favour; it has no
q/k norms. Everything else (48 layers, 128 experts of 768, top-8, 4 KV heads, the vocabulary) is
the same. Its sentencepiece tokenizer is never used (a stand-in module is given if it is missing).
"""

from __future__ import annotations

import importlib
import math
import sys
import time
import types
from pathlib import Path

import torch


def gpt_fast_modules(checkout: str):
    """(model, quantize, generate) modules of a gpt-fast checkout's mixtral-moe directory."""
    directory = Path(checkout) / "mixtral-moe"
    if not (directory / "model.py").is_file():
        raise SystemExit(f"--gpt-fast: {checkout} is not a gpt-fast checkout (no mixtral-moe/model.py)")
    sys.path.insert(0, str(directory))
    try:
        import sentencepiece  # noqa: F401
    except ImportError:  # generate.py imports it at the top; nothing here tokenizes
        sys.modules["sentencepiece"] = types.SimpleNamespace(SentencePieceProcessor=None)
    return (importlib.import_module(name) for name in ("model", "quantize", "generate"))


def gpt_fast_rows(config, args, device: torch.device) -> list[dict]:
    """gpt-fast's decode step at batch 1 on our shape, bf16 and int8 weight-only (module docstring)."""
    model_module, quantize, generate = gpt_fast_modules(args.gpt_fast)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    heads = config.hidden_size // head_dim
    shape = model_module.ModelArgs(
        block_size=args.prompt_len + args.new_tokens + 8,
        vocab_size=config.vocab_size,
        n_layer=config.num_hidden_layers,
        n_head=heads,
        n_local_heads=config.num_key_value_heads,
        dim=config.hidden_size,
        intermediate_size=config.moe_intermediate_size,
        rope_base=config.rope_theta,
        norm_eps=config.rms_norm_eps,
        num_experts=config.num_experts,
        num_activated_experts=config.num_experts_per_tok,
    )
    rows = []
    variants = args.gpt_fast_variants.split(",")
    if set(variants) - {"bf16", "int8"}:
        raise SystemExit(f"--gpt-fast-variants: {args.gpt_fast_variants!r}; gpt-fast's are bf16 and int8")
    for variant in variants:
        side = f"gpt-fast compiled, {heads} heads" + (", int8 weight-only" if variant == "int8" else "")
        try:
            ms, gib = _decode_ms(model_module, quantize, generate, shape, variant, args, device)
        except torch.OutOfMemoryError:
            rows.append({"side": side, "batch": 1, "ms/token": "out of memory", "_ms": math.inf})
            continue
        print(f"{side}: {ms:.2f} ms a token, {gib:.1f} GiB of weights", flush=True)
        rows.append({"side": side, "batch": 1, "ms/token": f"{ms:.2f}", "tokens/s": f"{1e3 / ms:,.0f}", "_ms": ms})
    return rows


def _decode_ms(model_module, quantize, generate, shape, variant: str, args, device: torch.device):
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the GPU: 61 GB in fp32 would not fit
    try:
        with torch.device(device), torch.no_grad():
            model = model_module.Transformer(shape)
            for parameter in model.parameters():
                if parameter.dim() > 1:
                    parameter.normal_(0.0, 0.02)
            if variant == "int8":
                handler = quantize.WeightOnlyBit8QuantHandler(model, torch.int8)
                state = handler.create_quantized_state_dict()
                model = handler.convert_for_runtime()
                model.load_state_dict(state, assign=True)
                del state
            model = model.eval()
            model.setup_caches(max_batch_size=1, max_seq_length=shape.block_size)  # as its generate(): on the GPU
    finally:
        torch.set_default_dtype(previous)
    gib = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())) / 2**30
    torch._inductor.config.assert_indirect_indexing = False  # as its generate() sets before compiling
    step = torch.compile(generate.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(1, shape.vocab_size, (1, args.prompt_len), device=device)
    sampling = {"temperature": 0.8, "top_k": 200}  # its generate.py's defaults
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with torch.no_grad():
        token = generate.prefill(model, prompt, torch.arange(args.prompt_len, device=device), **sampling)
        position = torch.tensor([args.prompt_len], device=device, dtype=torch.int)
        warm, timed = max(2, args.new_tokens // 4), args.new_tokens
        begin = None
        started = time.perf_counter()
        with sdpa_kernel(SDPBackend.MATH):  # its decode_n_tokens: math attention, for inductor to fuse
            for index in range(warm + timed):
                if index == warm:
                    torch.cuda.synchronize()
                    begin = time.perf_counter()
                    print(f"  gpt-fast {variant}: compiled and warm in {begin - started:.0f} s", flush=True)
                torch.compiler.cudagraph_mark_step_begin()  # a step's outputs are the next's inputs
                token, _ = step(model, token.view(1, -1), position)
                token = token.clone()  # (as its decode_n_tokens clones each): the graph's buffer is reused
                position += 1
        torch.cuda.synchronize()
    ms = (time.perf_counter() - begin) * 1e3 / timed
    del model, step
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return ms, gib
