"""How many experts a prefill touches in the random-weight Qwen3-30B-A3B shape, and what one
prompt's prefill costs with it: the yardstick of issue 28's time-to-first-token bound ("≤ 3× one
prompt's prefill").

A prompt's grouped GEMMs read the weights of every expert its tokens chose, so their time follows
the experts touched. bench/serve/serve_load.py's prompts are random letters (26 token ids), the other
benches' random ids over the vocabulary. This script counts, per MoE layer, the experts touched by
one prompt of each kind, by four, by 60 decode tokens (the last tokens of 60 sequences) and by a
loaded server's round (four prompts and the 60), and times one and four prompts' prefill through
the engine (one packed step, a CUDA graph); with the random weights' routing and with routing
spread over the experts as a trained router's is (bench/harness.py's `spread_routing`).

    PYTHONPATH=. python3 bench/serve/routing_coverage.py --layers 48
    PYTHONPATH=. python3 bench/serve/routing_coverage.py --config configs/tiny.toml   # CPU smoke check
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from bench.harness import (
    add_model_arguments,
    bench_model_config,
    moemesh_model,
    print_table,
    routers,
    spread_routing,
    timed,
)
from moemesh.inference.engine import Chunk, DecodeEngine

LETTERS = list(range(97, 123))  # the byte tokenizer's ids of a-z
BLOCK_SIZE = 16


def prompts(kind: str, count: int, length: int, vocab: int, generator) -> torch.Tensor:
    if kind == "letters":
        picks = torch.randint(0, len(LETTERS), (count, length), generator=generator)
        return torch.tensor(LETTERS)[picks]
    return torch.randint(1, vocab, (count, length), generator=generator)


def routed(model, ids: torch.Tensor, device) -> list[torch.Tensor]:
    """Each MoE layer's expert ids [B, T, k] for the batch `ids` (one eager forward, no cache)."""
    seen: list[torch.Tensor] = []
    hooks = [
        router.register_forward_hook(lambda m, args, out: seen.append(out.expert_ids)) for router in routers(model)
    ]
    try:
        with torch.no_grad():
            ids = ids.to(device)
            model.run_layers(model.model.embed_tokens(ids), torch.arange(ids.shape[1], device=device))
    finally:
        for hook in hooks:
            hook.remove()
    return [e.view(ids.shape[0], ids.shape[1], -1) for e in seen]


def coverage(layers: list[torch.Tensor], experts: int) -> dict:
    touched = [int(torch.unique(e).numel()) for e in layers]
    busiest = [int(torch.bincount(e.flatten(), minlength=experts).max()) for e in layers]
    return {
        "experts touched a layer: mean": f"{statistics.mean(touched):.1f} of {experts}",
        "min": min(touched),
        "max": max(touched),
        "busiest expert's rows (mean)": f"{statistics.mean(busiest):.0f}",
    }


def prefill_ms(model, ids: torch.Tensor, repeat: int) -> float:
    count, length = ids.shape
    engine = DecodeEngine(
        model,
        max_batch=max(4, count),
        max_len=length + 1,
        max_num_batched_tokens=count * length,
        num_blocks=2 + count * math.ceil(length / BLOCK_SIZE) + 4,
        block_size=BLOCK_SIZE,
    )
    for row in range(count):
        engine.set_blocks(row, engine.blocks.allocate(math.ceil(length / BLOCK_SIZE)))
    chunks = [Chunk(row, ids[row].tolist(), 0) for row in range(count)]
    engine.step(chunks)  # compiles and captures
    ms = statistics.median(timed(lambda: engine.step(chunks))[0] for _ in range(repeat)) * 1e3
    engine.close()
    return ms


def coverage_rows(model, config, kind: str, args) -> list[dict]:
    device, length, generator = next(model.parameters()).device, args.prompt_len, torch.Generator().manual_seed(0)
    one, four, sixty = (prompts(kind, n, length, config.vocab_size, generator) for n in (1, 4, 60))
    decode = [e[:, -1] for e in routed(model, sixty, device)]  # the 60 sequences' last tokens
    four_routed = routed(model, four, device)
    rows = []
    for name, layers in (
        ("1 prompt", routed(model, one, device)),
        ("4 prompts", four_routed),
        ("60 decode tokens", decode),
        (
            "a loaded round: 4 prompts + 60 decode tokens",
            [torch.cat([p.flatten(0, 1), d]) for p, d in zip(four_routed, decode)],
        ),
    ):
        rows.append({"routing": "", "prompts": kind, "tokens": name, **coverage(layers, config.num_experts)})
    rows[0]["prefill ms"] = f"{prefill_ms(model, one, args.repeat):.1f}"
    rows[1]["prefill ms"] = f"{prefill_ms(model, four, args.repeat):.1f}"
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, layers=48)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    model = moemesh_model(config, device)
    rows = []
    for routing in ("random weights'", "spread (bench/harness.py)"):
        if routing != "random weights'":
            spread_routing(model)
        for kind in ("letters", "vocabulary"):
            rows += coverage_rows(model, config, kind, args)
            rows[-4]["routing"] = routing
    title = f"experts touched per MoE layer, {config.num_hidden_layers} layers, prompts of {args.prompt_len} tokens"
    print_table(rows, title)


if __name__ == "__main__":
    main()
