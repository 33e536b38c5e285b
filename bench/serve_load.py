"""Load on a running `moemesh serve`: N concurrent clients, each streaming requests one after
another; prints completion tokens/s over the run and the time to first token (p50, p99).

    # a random-weight 6-layer Qwen3-30B-A3B-shaped checkpoint (bf16, 8.6 GB), then the server:
    PYTHONPATH=. python3 bench/serve_load.py --write-checkpoint /tmp/q6 --layers 6
    python3 -m moemesh serve --checkpoint /tmp/q6 --max-batch 64 --max-len 1024 &
    PYTHONPATH=. python3 bench/serve_load.py --clients 1,16,64 --requests 4 --prompt-len 512 --max-tokens 128

    # CPU smoke check: a tiny checkpoint, a few clients
    PYTHONPATH=. python3 bench/serve_load.py --write-checkpoint /tmp/tiny --config configs/tiny.toml
    python3 -m moemesh serve --checkpoint /tmp/tiny --port 8011 &
    PYTHONPATH=. python3 bench/serve_load.py --url http://127.0.0.1:8011 --clients 1,4 --requests 2 \\
        --prompt-len 16 --max-tokens 16

Prompts are random bytes (the byte tokenizer: a checkpoint written here has no tokenizer.json),
greedy, no stop strings; every request makes exactly --max-tokens tokens unless it samples the
end-of-document token. Time to first token: from sending the request to the first streamed
chunk (every token is streamed as a chunk, with or without text). Tokens: the servers' usage.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import httpx
import torch

from bench.common import print_table, qwen3_30b_a3b


def write_checkpoint(path: str, args) -> None:
    from moemesh.checkpoint.hf import save_pretrained
    from moemesh.config import load_config
    from moemesh.models import build

    config = load_config(args.config).model if args.config else qwen3_30b_a3b(args.layers)
    dtype = torch.bfloat16 if args.config is None else torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no fp32 copy of a large model
    try:
        model = build(config, seed=0)
    finally:
        torch.set_default_dtype(previous)
    save_pretrained(model, path)
    print(f"wrote {path}: {config.num_hidden_layers} layers, {str(dtype)[6:]}, random weights")


def one_client(url: str, headers: dict, args, seed: int, results: list) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, headers=headers, timeout=600) as http:
        for _ in range(args.requests):
            prompt = "".join(chr(rng.randint(97, 122)) for _ in range(args.prompt_len))
            body = {
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sent, first, tokens = time.perf_counter(), None, 0
            with http.stream("POST", "/v1/completions", json=body) as reply:
                reply.raise_for_status()
                for line in reply.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices"):
                        first = time.perf_counter() - sent
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            results.append((first, tokens))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", help="sent as a bearer token")
    parser.add_argument("--clients", default="1,16,64", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt bytes (= tokens after the first)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--write-checkpoint", metavar="DIR", help="write a random-weight checkpoint and exit")
    parser.add_argument("--layers", type=int, default=6, help="for --write-checkpoint: Qwen3-30B-A3B shape layers")
    parser.add_argument("--config", help="for --write-checkpoint: the model of this run config instead")
    args = parser.parse_args()
    if args.write_checkpoint:
        return write_checkpoint(args.write_checkpoint, args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(args.url + "/v1/models", headers=headers).json()["data"][0]["id"]
    rows = []
    for clients in (int(c) for c in args.clients.split(",")):
        results: list = []
        threads = [
            threading.Thread(target=one_client, args=(args.url, headers, args, i, results)) for i in range(clients)
        ]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        ttft = sorted(first for first, _ in results if first is not None)
        tokens = sum(n for _, n in results)
        rows.append(
            {
                "clients": clients,
                "requests": len(results),
                "completion tokens": tokens,
                "tokens/s": f"{tokens / wall:,.0f}",
                "TTFT p50 ms": f"{statistics.median(ttft) * 1e3:.0f}",
                "TTFT p99 ms": f"{ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3:.0f}",
            }
        )
    print_table(
        rows,
        f"moemesh serve load ({model} at {args.url}): prompt {args.prompt_len} bytes, "
        f"{args.max_tokens} tokens a request, {args.requests} requests a client, greedy, streamed",
    )


if __name__ == "__main__":
    main()
