"""Load on `moemesh serve` through the official `openai` client: N concurrent clients, each
streaming requests one after another; completion tokens/s over the run and the time to first
token (p50, p99), beside the engine alone on the very same workload (the scheduler driven in the
server's process, N requests in flight, no HTTP): the share of the engine the server delivers.

    # one GPU: a random-weight Qwen3-30B-A3B shape with `serve`'s default settings, then the load
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 1,16,64,256
    # the served side once per reply window (serve --reply-window-ms), one server
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 16,64 --reply-windows 0,10
    # CPU smoke check
    PYTHONPATH=. python3 bench/serve/serve_load.py --config configs/tiny.toml --clients 1,4 --requests 2 \\
        --prompt-len 16 --max-tokens 16
    # the server's own cost on a CPU: the forward replaced by waits of the 48-layer shape's times
    PYTHONPATH=. python3 bench/serve/serve_load.py --config configs/tiny.toml --serve-args '--max-batch 64' \\
        --clients 16,64 --long-prompt 0 --client-procs 1 --fake-step-ms 18
    # serve's two schedules (--schedule) on one server, with clients whose lengths drift apart
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 1,64 --schedules mixed,prefill-first \\
        --max-tokens-spread 0.5 --requests 6
    # serve's tokens a step (--max-num-batched-tokens) on one server: each value's engine alone and served
    # (at most the server's own budget: raise it for larger values)
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 1,64 --step-tokens 2048,1536,1024 \\
        --serve-args '--max-num-batched-tokens 2048'
    # against a server that runs already (no engine-alone column)
    PYTHONPATH=. python3 bench/serve/serve_load.py --url http://127.0.0.1:8000 --clients 1,16
    # the weights kept quantized as a published checkpoint's (issue 73): FP8, or gpt-oss-120b's MXFP4 experts
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 1,64 --quantize fp8
    PYTHONPATH=. python3 bench/serve/serve_load.py --config configs/gpt_oss_120b.toml --clients 1,64 --quantize mxfp4
    # the server under tensor parallelism: its child under torchrun on N GPUs (issue 49)
    PYTHONPATH=. python3 bench/serve/serve_load.py --layers 48 --clients 1,64 --tp 4

With --layers or --config this script starts the server itself, in a child process: the model
built on the device with random weights (no 61 GB checkpoint to write and read), the engine
`moemesh serve` would make with its defaults (cli's own parser and engine), and then
`inference.server.Service` on a free port. Before it serves, the child runs the engine-alone
side for every client count and reports its capacity: the pool's tokens, its rows, and one
request of --long-prompt tokens (a 32k context). Each side runs each workload twice and times
the second, so that both find the CUDA graphs of their batches and lengths captured. Clients run
in --client-procs processes (threads within each), so that their own Python bounds nothing.

Prompts are random lowercase letters (the byte tokenizer: a prompt of L letters is L tokens),
greedy, no end-of-sequence stop (the child's tokenizer has none): every request makes exactly
--max-tokens tokens. With --spread-routing the routers choose as a trained model's do, spread over
the experts (bench/harness.py's `spread_routing`): the random weights route one prompt's tokens to
a few experts, which makes one prompt's prefill, the yardstick of the first token's time under
load, several times cheaper than a served model's (bench/serve/routing_coverage.py).

Clients that start together and make equally long requests stay in step: every 128 rounds the
64 of them finish within ~16 rounds of each other, and their next prompts come as a burst, ~4 to
each round that prefills. With --max-tokens-spread S each request's length is drawn evenly from
max_tokens·(1 ± S) (the same draws on both sides), and the clients drift apart as real ones do:
then a round admits about one prompt at a time.

Time to first token: from sending the request to the first streamed chunk; beside it the engine
process's own view (p50): from the request's submission to the scheduler to its first token; the
mean time of a round, the CPU time a round of the scheduler's thread, of the engine process's
other threads and of the HTTP server's process (inference/link.py).

--fake-step-ms measures the server's own cost where there is no GPU: the model's forward becomes
a wait (GIL released, as while a GPU step is waited for) of that many ms a round, plus
--fake-prefill-ms and --fake-token-us a token for a round that prefills (the defaults, with 18
ms, follow the 48-layer shape on one H200: a decode round of 64 ~20 ms, a round of 4 prompts of
~500 tokens ~44 ms), and logits of zeros. The scheduler, the engine's host side, the HTTP server
and the clients are real; what the GPU's own host calls (launches, copies) cost is not in it.

--record: the served side's tokens/s and TTFT p50 at each client count, beside the engine alone's,
to the results file (bench/harness.py's `record`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from itertools import product

from bench.harness import add_model_arguments, add_record_flag, model_at, print_table, record


def client_requests(client: int, args) -> list[tuple[str, int]]:
    """Client `client`'s requests in pass `args.salt`: (prompt, max_tokens). Other passes' prompts
    differ (the prefix cache finds nothing of them); the lengths are the same in every pass, the
    engine alone's and the server's: --max-tokens, or with --max-tokens-spread S drawn evenly from
    max_tokens·(1 ± S)."""
    rng, lengths = random.Random(f"{args.salt} {client}"), random.Random(f"lengths {client}")
    low, high = (
        round(args.max_tokens * (1 - args.max_tokens_spread)),
        round(args.max_tokens * (1 + args.max_tokens_spread)),
    )
    return [
        ("".join(chr(rng.randint(97, 122)) for _ in range(args.prompt_len)), lengths.randint(low, high))
        for _ in range(args.requests)
    ]


def summary(side: str, clients: int, results: list[tuple[float, int]], wall: float) -> dict:
    ttft = sorted(first for first, _ in results)
    tokens = sum(n for _, n in results)
    return {
        "side": side,
        "clients": clients,
        "requests": len(results),
        "completion tokens": tokens,
        "tokens/s": tokens / wall,
        "TTFT p50 ms": statistics.median(ttft) * 1e3,
        "TTFT p99 ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
    }


# ---- the server's side (the child process) ---------------------------------------------------------
class StepClock:
    """A scheduler's rounds, counted and timed: wall time and the CPU time of the thread that runs
    them (it wraps `scheduler.step`)."""

    def __init__(self, scheduler):
        self.count, self.seconds, self.cpu_seconds, step = 0, 0.0, 0.0, scheduler.step

        def timed_step(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return step(*args, **kwargs)
            finally:
                self.count += 1
                self.seconds += time.perf_counter() - start
                self.cpu_seconds += time.thread_time() - cpu

        scheduler.step = timed_step

    def take(self) -> dict:
        """The rounds since the last call: how many, their mean time and the scheduler's CPU time
        a round, in ms."""
        rounds = max(1, self.count)
        taken = {
            "steps": self.count,
            "ms a step": self.seconds * 1e3 / rounds,
            "scheduler CPU ms a step": self.cpu_seconds * 1e3 / rounds,
        }
        self.count, self.seconds, self.cpu_seconds = 0, 0.0, 0.0
        return taken


def fake_forward(model, args) -> None:
    """The model's forward replaced by a wait of about a GPU step's time, the GIL released (as
    while a GPU step is waited for), and logits of zeros (greedy picks token 0): the scheduler, the
    engine's host side and the server run for real, the device's work is only time."""
    import torch

    def forward(ids, cache, positions, at=None):
        packed = ids.shape[0] == 1 and ids.shape[1] > 1  # a prefill round (decode rounds are [B, 1])
        prefill_ms = args.fake_prefill_ms + ids.numel() * args.fake_token_us / 1e3 if packed else 0.0
        time.sleep((args.fake_step_ms + prefill_ms) / 1e3)
        return torch.zeros(ids.shape[0] if at is None else len(at), model.config.vocab_size, device=ids.device)

    model.next_token_logits = forward


def engine_alone(scheduler, clock: StepClock, tokenizer, clients: int, args) -> dict:
    """The workload of `clients` clients through the scheduler alone: each client's next request
    is submitted when its previous one finishes."""
    from moemesh.inference.request import SamplingParams

    queues = {c: [(tokenizer.encode(text), n) for text, n in client_requests(c, args)] for c in range(clients)}
    first: dict = {}
    results, waited = [], []

    def on_update(sequence, text):
        first.setdefault(sequence, (time.perf_counter(), clock.count))

    def submit(client: int):
        sent, (ids, max_tokens) = (time.perf_counter(), clock.count), queues[client].pop(0)
        return scheduler.submit(ids, SamplingParams(max_tokens=max_tokens), on_update), sent, client

    clock.take()
    start = time.perf_counter()
    running = [submit(c) for c in range(clients)]
    while running:
        scheduler.step()
        for entry in [e for e in running if e[0].finish_reason is not None]:
            sequence, sent, client = entry
            running.remove(entry)
            results.append((first[sequence][0] - sent[0], len(sequence.token_ids)))
            waited.append(first[sequence][1] - sent[1])
            if queues[client]:
                running.append(submit(client))
    row = summary("engine alone", clients, results, time.perf_counter() - start)
    return {**row, "steps to first token p50": statistics.median(waited), **clock.take()}


def serve_child(args) -> None:
    import torch

    from bench.harness import bench_model_config, moemesh_model, spread_routing, tensor_parallel_model
    from moemesh.cli import _engine, _parser
    from moemesh.data.tokenizer import ByteTokenizer
    from moemesh.inference.request import SamplingParams
    from moemesh.inference.scheduler import Scheduler
    from moemesh.inference.server import Service

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = bench_model_config(args)
    if not args.config:  # the real model's context: 40,960 positions
        config = config.replace(max_position_embeddings=40960)
    config = config.replace(output_router_logits=False)
    group = None
    if args.tp > 1:  # under torchrun: rank 0 serves, the others follow its steps
        model, group = tensor_parallel_model(config)
    elif args.quantize:
        from bench.serve.decode import quantized_model

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = quantized_model(config, device, dtype, args.quantize)
    else:
        model = moemesh_model(config, device)
    if args.spread_routing:
        spread_routing(model)
    if args.fake_step_ms is not None:
        fake_forward(model, args)
    serve_args = _parser().parse_args(["serve", "--checkpoint", "random", *args.serve_args.split()])
    limit = config.max_position_embeddings
    engine = _engine(
        serve_args, model, group, serve_args.max_len or (limit if device.type == "cuda" else min(limit, 4096))
    )
    if not engine.leader:
        return engine.follow()
    tokenizer = ByteTokenizer()
    tokenizer.eos_id = None  # every request makes --max-tokens tokens
    warm_up = engine.warm_up()
    scheduler = Scheduler(engine, tokenizer, max_waiting=1 << 20, overlap=not serve_args.no_overlap)
    clock = StepClock(scheduler)
    report = {
        "capacity": f"{engine.capacity:,} tokens in {engine.cache.num_blocks - 1:,} blocks of {engine.block_size}, "
        f"{engine.max_batch} rows, context {engine.max_len:,}, {engine.max_num_batched_tokens} tokens a step; "
        f"warm-up {warm_up:.0f} s",
        "engine": [],
    }
    if args.long_prompt and engine.max_len > args.long_prompt:
        ids = torch.randint(97, 123, (args.long_prompt,)).tolist()
        start = time.perf_counter()
        sequence = scheduler.submit(ids, SamplingParams(max_tokens=16))
        scheduler.run_until_idle()
        seconds = time.perf_counter() - start
        report["long"] = (
            f"one prompt of {args.long_prompt:,} tokens + 16 new: {seconds:.2f} s ({sequence.finish_reason})"
        )
    budget = engine.max_num_batched_tokens
    if max(args.step_token_values, default=0) > budget:  # the cache and the CUDA graphs are sized for serve's
        raise SystemExit(f"--step-tokens {args.step_tokens}: at most serve's --max-num-batched-tokens ({budget})")
    for clients in args.client_counts:
        for schedule in args.schedule_names or [serve_args.schedule]:
            for step_tokens in args.step_token_values or [None]:
                scheduler.prefill_first = schedule == "prefill-first"
                engine.max_num_batched_tokens = step_tokens or budget
                args.salt = f"engine warm-up {clients} {schedule} {step_tokens}"
                engine_alone(scheduler, clock, tokenizer, clients, args)  # warm-up: graphs of these batches and lengths
                args.salt = f"engine {clients} {schedule} {step_tokens}"
                row = engine_alone(scheduler, clock, tokenizer, clients, args)
                report["engine"].append({"schedule": schedule, "step tokens": step_tokens or budget, **row})
    engine.max_num_batched_tokens = budget
    print("REPORT " + json.dumps(report), flush=True)
    service = Service(
        engine,
        tokenizer,
        model_name="random",
        max_waiting=max(args.client_counts) + 1,
        reply_window_ms=serve_args.reply_window_ms,
        prefill_first=serve_args.schedule == "prefill-first",
        overlap=not serve_args.no_overlap,
    )
    timed_inside(service, args.port + 1)
    service.serve("127.0.0.1", args.port, announce=True)


def process_cpu_seconds(pid: int) -> float:
    """A process's CPU time, all its threads' (Linux: /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_inside(service, port: int) -> None:
    """Where a served request's time to first token goes, seen from the engine's process: from its
    submission to the scheduler to its first update, with the rounds between the two; and the CPU
    time a round of the scheduler's thread, of this process's other threads and of the HTTP
    process. `GET http://127.0.0.1:<port>/inside` (a small server of its own) returns them since
    the last call; with `?reply_window_ms=W` it sets the scheduler's reply window for what follows."""
    import http.server
    import urllib.parse

    waits: list[tuple[float, int]] = []
    clock = StepClock(service.scheduler)
    cpu = {"self": process_cpu_seconds(os.getpid()), "http": 0.0}
    windows = Counter(service.scheduler.reply_windows)  # up to the last call
    submit = service.scheduler.submit

    def timed_submit(prompt_ids, params, on_update=None):
        submitted, rounds, first = time.perf_counter(), clock.count, []

        def relay(sequence, text):
            if not first:
                first.append(True)
                waits.append(((time.perf_counter() - submitted) * 1e3, clock.count - rounds))
            if on_update is not None:
                on_update(sequence, text)

        return submit(prompt_ids, params, relay)

    def inside(query: dict) -> dict:
        if "reply_window_ms" in query:  # the next load's
            service.scheduler.reply_window_s = float(query["reply_window_ms"][0]) / 1e3
        if "schedule" in query:
            service.scheduler.prefill_first = query["schedule"][0] == "prefill-first"
        if "step_tokens" in query:
            service.engine.max_num_batched_tokens = int(query["step_tokens"][0])
        rounds, now = max(1, clock.count), process_cpu_seconds(os.getpid())
        http_now = process_cpu_seconds(service.http.pid)
        taken = {
            "requests": list(waits),
            "other threads' CPU ms a step": ((now - cpu["self"]) - clock.cpu_seconds) * 1e3 / rounds,
            "HTTP process CPU ms a step": (http_now - cpu["http"]) * 1e3 / rounds,
            **clock.take(),
            "reply window ms": service.scheduler.reply_window_s * 1e3,
            "reply windows caught/partly/missed/skipped": "/".join(
                str(service.scheduler.reply_windows[end] - windows[end])
                for end in ("caught", "partly", "missed", "skipped")
            ),
            "schedule": "prefill-first" if service.scheduler.prefill_first else "mixed",
            "step tokens": service.engine.max_num_batched_tokens,
        }
        cpu["self"], cpu["http"] = now, http_now
        windows.clear()
        windows.update(service.scheduler.reply_windows)
        waits.clear()
        return taken

    class Control(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = json.dumps(inside(urllib.parse.parse_qs(urllib.parse.urlparse(self.path).query))).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    control = http.server.ThreadingHTTPServer(("127.0.0.1", port), Control)
    threading.Thread(target=control.serve_forever, daemon=True).start()
    service.scheduler.submit = timed_submit


# ---- the clients -------------------------------------------------------------------------------------
def client_process(url: str, model: str, clients: list[int], args, barrier, out) -> None:
    from openai import OpenAI

    openai = OpenAI(base_url=url + "/v1", api_key=args.api_key or "none", max_retries=0, timeout=3600)
    results: list = []

    def one_client(client: int):
        for prompt, max_tokens in client_requests(client, args):
            sent, first, tokens = time.perf_counter(), None, 0
            stream = openai.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            for chunk in stream:
                if first is None and chunk.choices:
                    first = time.perf_counter() - sent
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results.append((first, tokens))

    threads = [threading.Thread(target=one_client, args=(c,)) for c in clients]
    barrier.wait()  # every process imported and ready: the clock starts in the parent now
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(results)


def load(url: str, model: str, clients: int, args) -> dict:
    context = multiprocessing.get_context("spawn")
    procs = min(args.client_procs, clients)
    barrier, out = context.Barrier(procs + 1), context.Queue()
    workers = [
        context.Process(target=client_process, args=(url, model, list(range(p, clients, procs)), args, barrier, out))
        for p in range(procs)
    ]
    for w in workers:
        w.start()
    barrier.wait()
    start = time.perf_counter()
    results = [r for _ in workers for r in out.get()]
    wall = time.perf_counter() - start
    for w in workers:
        w.join()
    return summary("moemesh serve", clients, results, wall)


def record_served(args, served: str | None, row: dict, alone: dict | None) -> None:
    """--record: the served side's tokens/s and TTFT p50 at this client count, beside the engine
    alone's; the model this script started (`served`: the name a running server gave), and the
    settings the run varies."""
    at = {
        **(model_at(args) if served is None else {"model": served}),
        "clients": row["clients"],
        "requests": args.requests,
        "gpus": args.tp if args.tp > 1 else None,
        "schedule": row.get("schedule") if args.schedules else None,
        "step_tokens": row.get("step tokens") if args.step_tokens else None,
        "reply_window_ms": row.get("reply window ms") if args.reply_windows else None,
        "base": args.quantize,
    }
    peer = "engine alone" if alone else ""
    for figure, key, unit in (("serve tokens/s", "tokens/s", "tokens/s"), ("serve TTFT p50 ms", "TTFT p50 ms", "ms")):
        record(figure, at, row[key], unit, peer, alone and alone[key], gpus=args.tp)


def start_server(args) -> tuple[subprocess.Popen, str, dict]:
    """The child server; returns once it listens, with its URL and its report."""
    port = args.port
    command = [sys.executable, __file__, "--serve", "--port", str(port), "--clients", args.clients]
    if args.tp > 1:
        command[:1] = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.tp)]
    names = ("layers", "config", "requests", "prompt_len", "max_tokens", "max_tokens_spread", "long_prompt", "tp")
    names += ("serve_args", "schedules", "step_tokens")
    names += ("fake_step_ms", "fake_prefill_ms", "fake_token_us", "spread_routing", "quantize")
    for name in names:
        value = getattr(args, name)
        if value is True:
            command.append(f"--{name.replace('_', '-')}")
        elif value is not None and value is not False:  # 0 too: --long-prompt 0; "=": a value may start with "--"
            command.append(f"--{name.replace('_', '-')}={value}")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    report = None
    for line in child.stdout:
        if line.startswith("REPORT "):
            report = json.loads(line[7:])
            for row in report["engine"]:  # now, in case the served side does not finish
                print(
                    "  server: engine alone: "
                    + ", ".join(f"{k} {v:,.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
                )
        elif " on http://" in line:
            threading.Thread(target=lambda: [None for _ in child.stdout], daemon=True).start()  # drain
            return child, line.split(" on ")[-1].strip(), report
        else:
            print("  server: " + line.rstrip(), flush=True)
    raise SystemExit(f"the server exited ({child.wait()}) before it listened")


def main():
    from moemesh.cli import inference_allocator

    inference_allocator()  # as `moemesh serve` runs, and the child inherits it (gpt-oss-120b's prefill needs it)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a server that runs already (else one is started: --layers or --config)")
    parser.add_argument("--api-key", help="sent as a bearer token")
    parser.add_argument("--clients", default="1,16,64", help="comma-separated numbers of concurrent clients")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (letters)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--max-tokens-spread",
        type=float,
        default=0.0,
        help="each request's max_tokens drawn evenly from max_tokens·(1 ± this): clients that started together "
        "drift apart, as real ones do (0: every request makes max_tokens, and the clients stay in step)",
    )
    add_model_arguments(parser, layers=6)  # the served model
    parser.add_argument(
        "--spread-routing",
        action="store_true",
        help="the routers' choices spread over the experts as a trained model's are (bench/harness.py)",
    )
    parser.add_argument("--serve-args", default="", help="moemesh serve options for the child, e.g. '--max-batch 64'")
    parser.add_argument("--long-prompt", type=int, default=32000, help="the capacity check's prompt (0: none)")
    parser.add_argument("--client-procs", type=int, default=8)
    parser.add_argument(
        "--schedules",
        help="comma-separated serve --schedule values (mixed, prefill-first), each an engine-alone and a served run "
        "(default: serve's)",
    )
    parser.add_argument(
        "--reply-windows", help="comma-separated --reply-window-ms values, each a served run (default: serve's)"
    )
    parser.add_argument(
        "--step-tokens",
        help="comma-separated serve --max-num-batched-tokens values, at most serve's, each an engine-alone and a "
        "served run (default: serve's)",
    )
    parser.add_argument(
        "--fake-step-ms",
        type=float,
        help="the server's own cost on a CPU: the forward replaced by a wait of this many ms a round (module doc)",
    )
    parser.add_argument(
        "--fake-prefill-ms", type=float, default=6.0, help="with --fake-step-ms: more for a prefill round"
    )
    parser.add_argument("--fake-token-us", type=float, default=10.0, help="with --fake-step-ms: more a prefill token")
    parser.add_argument("--port", type=int, default=8013, help="the server's (and the next one, its bench control's)")
    parser.add_argument("--tp", type=int, default=1, help="the started server's tensor-parallel GPUs")
    parser.add_argument(
        "--quantize",
        choices=["fp8", "mxfp4"],
        help="the started server's weights kept in this format, as a published checkpoint's are "
        "(bench/serve/decode.py's quantized_model: random weights quantized at build)",
    )
    add_record_flag(parser)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    args.client_counts = [int(c) for c in args.clients.split(",")]
    args.schedule_names = args.schedules.split(",") if args.schedules else []
    if set(args.schedule_names) - {"mixed", "prefill-first"}:
        parser.error(f"--schedules takes mixed and prefill-first, got {args.schedules}")
    args.reply_windows = [float(w) for w in args.reply_windows.split(",")] if args.reply_windows else []
    args.step_token_values = [int(t) for t in args.step_tokens.split(",")] if args.step_tokens else []
    if args.quantize and args.tp > 1:
        parser.error("--quantize: one GPU's server only (the tensor-parallel child builds dense weights)")
    if args.fake_step_ms is not None and not args.config:
        parser.error("--fake-step-ms wants --config of a small model (configs/tiny.toml): its weights go unused")
    if args.serve:
        return serve_child(args)
    child, report = None, None
    url = args.url
    if url is None:
        child, url, report = start_server(args)
    try:
        import httpx

        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"]
        rows = []
        engine_rows = {(r["clients"], r["schedule"], r["step tokens"]): r for r in (report or {}).get("engine", [])}
        control = f"http://127.0.0.1:{args.port + 1}/inside"
        for clients in args.client_counts:
            args.salt = f"serve warm-up {clients}"
            load(url, model, clients, args)  # warm-up, as the engine's side had
            for schedule, step_tokens in product(args.schedule_names or [None], args.step_token_values or [None]):
                wanted = (clients, schedule, step_tokens)  # None: serve's own, the one the engine ran
                alone = next(
                    (r for key, r in engine_rows.items() if all(w in (None, k) for w, k in zip(wanted, key))), None
                )
                if alone:
                    rows.append(dict(alone))
                for window in args.reply_windows or [None]:
                    args.salt = f"serve {clients} {schedule} {step_tokens} {window}"
                    settings = {"reply_window_ms": window, "schedule": schedule, "step_tokens": step_tokens}
                    if child is not None:
                        httpx.get(control, params={k: v for k, v in settings.items() if v is not None})
                    row = load(url, model, clients, args)
                    if child is not None:  # the server's own view of the first token
                        inside = httpx.get(control).json()
                        waits = inside.pop("requests")
                        row["schedule"] = inside.pop("schedule")
                        row["step tokens"] = inside.pop("step tokens")
                        row["reply window ms"] = inside.pop("reply window ms")
                        row["submit → first token p50 ms"] = statistics.median(ms for ms, _ in waits)
                        row["steps to first token p50"] = statistics.median(n for _, n in waits)
                        row.update(inside)
                    if alone:
                        row["of the engine"] = f"{row['tokens/s'] / alone['tokens/s']:.0%}"
                    rows.append(row)
                    if args.record:
                        record_served(args, model if args.url else None, row, alone)
        for row in rows:
            for key, value in row.items():
                if isinstance(value, float):
                    digits = 1 if "CPU" in key else 0
                    row[key] = f"{value:g}" if key.startswith("steps") else f"{value:,.{digits}f}"
        kept = f", weights kept in {args.quantize}" if args.quantize else ""
        title = (
            f"moemesh serve under load ({model} at {url}{kept}): prompt {args.prompt_len} tokens, {args.max_tokens} "
            + (f"± {args.max_tokens_spread:.0%} " if args.max_tokens_spread else "")
            + f"new tokens a request, {args.requests} requests a client, greedy, streamed, openai client"
        )
        if report:
            title += f"; {report['capacity']}" + (f"; {report['long']}" if "long" in report else "")
        print_table(rows, title)
    finally:
        if child is not None:
            child.terminate()
            child.wait(timeout=60)


if __name__ == "__main__":
    main()
