"""The `moemesh` command: train, generate, serve, data, estimate, convert.

A mistake in what the user gave (arguments, config, data, checkpoint) or a diverged run prints one
line and exits with code 2; a collective that failed (a peer that stopped, died or timed out) prints
one line per rank that saw it and exits with code 1; anything else is a bug and keeps its traceback.

Under torchrun every rank reads the same arguments, config, data and checkpoints, so every rank
meets the same mistake: rank 0 alone says it. Each line is also written to torchrun's error file
(TORCHELASTIC_ERROR_FILE), so that torchrun's report of the failed workers names it instead of
pointing to a traceback. torchrun itself exits with 1 whenever a worker fails (`launch_agent`
raises ChildFailedError), whatever code the worker returned.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import sys
import time
from pathlib import Path

from moemesh.errors import MoemeshError
from moemesh.inference.parsers.registry import REASONING_PARSERS as REASONING_PARSER_NAMES
from moemesh.inference.parsers.registry import TOOL_CALL_PARSERS

TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


_QUIET_RANK_DELAY_S = 1.0


class _Parser(argparse.ArgumentParser):
    """One line for bad arguments (argparse's own prints its usage first), from rank 0 only."""

    def error(self, message: str):
        _say_once(f"{self.prog}: error: {message}")
        self.exit(2)


def _add_overrides(command: argparse.ArgumentParser, help: str) -> None:
    """`--set KEY=VALUE ...`, repeatable: overrides of the run config, as every command reads them."""
    command.add_argument(
        "--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE", help=help
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moemesh", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model (default: configs/tiny.toml on the stdlib corpus)")
    train.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    _add_overrides(train, "override a config value, e.g. --set train.steps=100 model.num_experts=16")

    generate = commands.add_parser("generate", help="continue prompts with a trained model")
    _model_arguments(generate)
    prompts = generate.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt: the prompt and its continuation are printed")
    prompts.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="many prompts, generated together: one a line, every line as written (an empty line is an empty "
        'prompt: the output has a row for each line, in order), or a .jsonl file of {"prompt": ..., optional '
        '"max_tokens", "temperature", "top_p", "seed", "stop"} a line (blank lines skipped); writes one JSON '
        "object a line (prompt, text, finish_reason, token counts)",
    )
    generate.add_argument("--output", metavar="FILE", help="where the JSON lines go (default: standard output)")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--stop", action="append", default=[], help="a string that ends the text (repeatable)")

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions) with continuous batching",
    )
    _model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key", help="clients must send it as a bearer token (default: env MOEMESH_API_KEY; unset: no key)"
    )
    serve.add_argument("--model-name", help="the model's name in the API (default: the checkpoint directory's)")
    serve.add_argument(
        "--max-waiting", type=int, default=64, help="requests that may wait for a free row; beyond, 503 (default 64)"
    )
    serve.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger bodies get 413 (default 1 MiB)")
    serve.add_argument(
        "--reply-window-ms",
        type=float,
        default=25.0,
        help="after a step that finished requests, wait up to this long for as many new ones before the next, "
        "so that clients answering at once join it (default 25; 0: never wait)",
    )
    serve.add_argument(
        "--schedule",
        choices=("mixed", "prefill-first"),
        default="mixed",
        help="mixed: new prompts' chunks share each step with the decode tokens (default); prefill-first: "
        "waiting prompts get a step of their own between decode steps, a shorter time to the first token "
        "for some tokens/s",
    )
    serve.add_argument(
        "--no-overlap",
        action="store_true",
        help="read each step's tokens before launching the next (by default the next is launched first, so "
        "that the host's work between steps overlaps the GPU's: more tokens/s, but a request that comes while "
        "a step runs joins a step later)",
    )

    serve.add_argument(
        "--tool-call-parser",
        choices=(*TOOL_CALL_PARSER_NAMES, "none"),
        help="the format of the model's tool calls (default: chosen from its chat template and model type; "
        "none: replies are content)",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=(*REASONING_PARSER_NAMES, "none"),
        help="the format of the model's reasoning, returned as reasoning_content (default: chosen as the tool-call "
        "parser is; none: reasoning stays in the content)",
    )

    data = commands.add_parser(
        "data", help="show the training sequences as the trainer reads them, trained tokens marked, and their counts"
    )
    data.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    _add_overrides(data, "override a config value, as for `moemesh train`")
    data.add_argument("--show", type=int, default=0, metavar="N", help="print the first N sequences")
    data.add_argument(
        "--output", metavar="FILE.jsonl", help='write each sequence as {"input_ids", "labels", "position_ids"}'
    )

    estimate = commands.add_parser("estimate", help="per-layer memory and time, pipeline stages, per-rank memory")
    estimate.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    _add_overrides(estimate, "override a config value, as for `moemesh train`")
    estimate.add_argument("--pp", type=int, help="pipeline ranks (default: parallel.pp)")
    estimate.add_argument("--schedule", choices=("dualpipev", "1f1b"), help="default: parallel.pp_schedule")
    estimate.add_argument(
        "--profile",
        action="store_true",
        help="measure each layer (one forward and backward on random tokens, on the "
        "config's device) instead of the analytical estimate",
    )

    convert = commands.add_parser(
        "convert",
        help="Hugging Face directory <-> moemesh checkpoint; a LoRA run -> PEFT adapter (direction from SRC)",
    )
    convert.add_argument(
        "source", metavar="SRC", help="Hugging Face directory, checkpoint or run directory (a LoRA run's too)"
    )
    convert.add_argument("target", metavar="DST", help="new directory to write")
    convert.add_argument(
        "--dtype",
        choices=_DTYPE_NAMES,
        help="weight dtype of what is written (default: as stored; a quantized source's dequantized weights: "
        "float32); with --quantize, of the tensors left unquantized",
    )
    convert.add_argument(
        "--quantize",
        choices=("fp8", "mxfp4"),
        help="write a quantized Hugging Face directory in the family's published layout: fp8 (128x128 block "
        "scales: DeepSeek, Qwen3-MoE, Mixtral) or mxfp4 (gpt-oss's experts); SRC any model directory",
    )
    convert.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run or PEFT adapter: write its base with the adapters merged in, as a Hugging Face "
        "directory (default: a PEFT adapter directory)",
    )
    convert.add_argument("--base", help="with --merge: the base model's directory (default: the run's train.init_from)")
    return parser


def _model_arguments(command: argparse.ArgumentParser) -> None:
    model = command.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--checkpoint",
        help="checkpoint directory, run directory (newest checkpoint) or Hugging Face directory",
    )
    model.add_argument(
        "--config",
        metavar="TOML",
        help="instead of a checkpoint: a moemesh config's model, its weights drawn from train.seed on each rank "
        "(its text is noise: for measuring speed and memory before a checkpoint exists)",
    )
    command.add_argument(
        "--adapter",
        metavar="DIR",
        help="LoRA adapters for the model: a PEFT adapter directory or a LoRA run (merged into the weights at load)",
    )
    command.add_argument("--tokenizer", help="'bytes' or a tokenizer.json (default: the checkpoint's, else bytes)")
    command.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    command.add_argument(
        "--dtype",
        choices=("auto", *_DTYPE_NAMES),
        default="auto",
        help="weights and KV cache (auto: bfloat16 on a GPU, float32 on a CPU)",
    )
    quantized = command.add_mutually_exclusive_group()
    quantized.add_argument(
        "--quantize",
        choices=("fp8",),
        help="keep the projections and expert banks of a bf16 Hugging Face checkpoint in block FP8 (128 x 128 "
        "tiles, the published rule), quantized at load; the decoding kernels read the codes (an FP8 or MXFP4 "
        "checkpoint's quantized weights stay quantized without it)",
    )
    quantized.add_argument(
        "--dequantize",
        action="store_true",
        help="read an FP8 or MXFP4 checkpoint's quantized weights dense, in --dtype (default: kept in their codes)",
    )
    command.add_argument(
        "--max-batch",
        type=int,
        help="sequences running together (block-table rows; default 256 on a GPU, 16 on a CPU)",
    )
    command.add_argument(
        "--max-len",
        type=int,
        help="tokens a sequence may hold, prompt included (default: what the prompts need; "
        "for serve max_position_embeddings on a GPU, min(max_position_embeddings, 4096) on a CPU)",
    )
    command.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="tokens one step computes at most: every decoding sequence's next, then chunks of prompts "
        "(default: 8192 for generate; 1536 for serve, so that prompts reach their first tokens in short "
        "steps: about two prompts of 512 tokens beside the decoding sequences)",
    )
    command.add_argument(
        "--packed-graph-tokens",
        type=int,
        help="steps of prompt chunks up to this many tokens run as CUDA graphs, padded to a few sizes "
        "(default min(2048, --max-num-batched-tokens) on a GPU; 0: eagerly)",
    )
    command.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of the GPU's memory that weights, activations and the KV cache may take; the cache "
        "gets what the other two leave (default 0.9)",
    )
    command.add_argument(
        "--kv-blocks",
        type=int,
        help="KV cache blocks instead (default: from --gpu-memory-fraction on a GPU, --max-batch x --max-len on a CPU)",
    )
    command.add_argument("--block-size", type=int, default=16, help="tokens a KV cache block holds (default 16)")
    command.add_argument(
        "--no-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="do not reuse the cached blocks of a prompt's prefix computed for an earlier request",
    )
    command.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks, launched as `torchrun --nproc-per-node N -m moemesh ... --tp N`: "
        "each rank reads only its shard (attention heads and their KV cache, expert slices, "
        "vocabulary); rank 0 prints or serves",
    )
    command.add_argument(
        "--batch-invariant",
        action="store_true",
        help="each sequence's tokens and log-probabilities the same bits whatever else runs with it, and equal "
        "to the trainer's forward in that mode (CUDA graphs on a GPU; its price in docs/benchmarks.md)",
    )
    command.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel ranks instead (torchrun --nproc-per-node N ... --ep N): each rank keeps E/N "
        "experts and computes their share of every token; attention, its KV cache and the vocabulary "
        "are whole on every rank (one all-reduce a MoE layer); rank 0 prints or serves. With --tp N of "
        "the same N: attention, KV cache and vocabulary split as --tp splits them, the experts whole, E/N "
        "a rank (vLLM's --enable-expert-parallel): faster than --tp N alone at many concurrent streams "
        "(1.06-1.07x at batch 64 on H200s), slower at one",
    )
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        nargs="+",
        default=[],
        metavar="parallel.tp=N",
        help="the same as --tp N (or --ep N: parallel.ep=N), spelled as for `moemesh train`",
    )


def _train(args: argparse.Namespace) -> None:
    from moemesh.checkpoint.load import init_source
    from moemesh.config import load_config
    from moemesh.train.trainer import train

    overrides = [item for group in args.overrides for item in group]
    train(load_config(args.config, overrides, init_source=init_source))


def _generate(args: argparse.Namespace) -> None:
    from moemesh.inference.generate import generate, read_prompts
    from moemesh.inference.request import SamplingParams, check_request, prompt_ids

    defaults = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed, tuple(args.stop))
    _checked(defaults)
    prompts = read_prompts(args.prompts_file, defaults) if args.prompts_file else [(None, args.prompt, defaults)]
    with _loaded(args) as (model, tokenizer, group):
        requests = []
        for line, text, params in prompts:
            with _prompt_named(args, line):
                requests.append((prompt_ids(tokenizer, text), params))
        limit = model.config.max_position_embeddings
        max_len = args.max_len or min(limit, max(len(ids) + params.max_tokens for ids, params in requests))
        for (line, _, _), (ids, params) in zip(prompts, requests):
            with _prompt_named(args, line):
                check_request(ids, params, min(max_len, limit))
        engine = _engine(args, model, group, max_len, len(requests))
        if not engine.leader:
            return engine.follow()
        try:
            results = generate(engine, tokenizer, [ids for ids, _ in requests], [params for _, params in requests])
        finally:
            engine.close()
        _say_where_cut(results, [params for _, params in requests], max_len, limit, args)
        if args.prompt is not None:
            print(args.prompt + results[0].text)
            return
        lines = [
            json.dumps(
                {
                    "prompt": text,
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "prompt_tokens": len(r.prompt_ids),
                    "completion_tokens": len(r.token_ids),
                },
                ensure_ascii=False,
            )
            for (_, text, _), r in zip(prompts, results)
        ]
        if args.output:
            Path(args.output).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        else:
            print("\n".join(lines))


@contextlib.contextmanager
def _prompt_named(args: argparse.Namespace, line: int | None):
    """A prompt that cannot run, named as the command line gave it: --prompt, or its file's line."""
    from moemesh.errors import RequestError

    try:
        yield
    except RequestError as e:
        where = "--prompt" if line is None else f"--prompts-file {args.prompts_file} line {line}"
        raise MoemeshError(f"{where}: {e}") from None


def _say_where_cut(results, params, max_len: int, limit: int, args: argparse.Namespace) -> None:
    """One line on standard error for sequences that ended at the end of the context, before the
    new tokens asked for (their finish_reason is "length", as for those that got them all)."""
    cut = [
        i
        for i, (r, p) in enumerate(zip(results, params))
        if len(r.token_ids) < p.max_tokens and r.finish_reason == "length"
    ]
    if not cut:
        return
    what = f"the model's position limit ({limit} tokens)" if max_len >= limit else f"--max-len {max_len}"
    r, p = results[cut[0]], params[cut[0]]
    if args.prompt is not None:
        print(
            f"moemesh generate: stopped at {what}, prompt included: {len(r.token_ids)} of the "
            f"{p.max_tokens} new tokens asked for",
            file=sys.stderr,
        )
    else:
        print(
            f"moemesh generate: {len(cut)} of {len(results)} prompts stopped at {what}, prompt "
            f'included, before their max_tokens (the first: prompt {cut[0] + 1}); finish_reason "length"',
            file=sys.stderr,
        )


def _serve(args: argparse.Namespace) -> None:
    from moemesh.inference.server import serve

    api_key = args.api_key or os.environ.get("MOEMESH_API_KEY") or None
    for name in ("port", "max_waiting", "max_request_bytes"):
        if getattr(args, name) < (0 if name == "port" else 1):
            raise MoemeshError(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'port' else '>= 1'}")
    if not 0 <= args.reply_window_ms <= 1000:
        raise MoemeshError(f"--reply-window-ms must be between 0 and 1000, got {args.reply_window_ms}")
    # The port is taken before the weights are read: a busy one fails now, not a minute later.
    sock = _listening_socket(args.host, args.port) if _is_rank_zero() else None
    with _loaded(args) as (model, tokenizer, group):
        limit = model.config.max_position_embeddings
        on_gpu = next(model.parameters()).is_cuda
        engine = _engine(args, model, group, args.max_len or (limit if on_gpu else min(limit, 4096)))
        if not engine.leader:
            return engine.follow()
        serve(
            engine,
            tokenizer,
            host=args.host,
            port=args.port,
            sock=sock,
            api_key=api_key,
            model_name=args.model_name
            or (Path(args.config).stem if args.config else Path(args.checkpoint).resolve().name),
            max_waiting=args.max_waiting,
            max_request_bytes=args.max_request_bytes,
            reply_window_ms=args.reply_window_ms,
            prefill_first=args.schedule == "prefill-first",
            overlap=not args.no_overlap,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
        )


def _engine(args: argparse.Namespace, model, group, max_len: int, requests: int | None = None):
    """The decode engine of generate (`requests` prompts) and serve (None), from the command line's
    settings: on a GPU the KV cache takes what --gpu-memory-fraction leaves after the weights and
    the largest step's activations, on a CPU --max-batch rows of --max-len (unless --kv-blocks
    says)."""
    from moemesh.inference.engine import DecodeEngine

    on_gpu = next(model.parameters()).is_cuda
    max_batch = args.max_batch or (256 if on_gpu else 16)
    # serve's steps: 1536 tokens took the first token p50 of 64 clients in step from 56-57 to 47-48 ms
    # for 1-4% of the tokens/s against 2048 (48 layers, one H200; docs/benchmarks.md, 2026-11-26)
    step_tokens = 1536 if requests is None else 8192
    try:
        return DecodeEngine(
            model,
            max_batch=max_batch if requests is None else min(max_batch, requests),
            max_len=max_len,
            max_num_batched_tokens=args.max_num_batched_tokens or step_tokens,
            packed_graph_tokens=args.packed_graph_tokens,
            block_size=args.block_size,
            num_blocks=args.kv_blocks,
            gpu_memory_fraction=args.gpu_memory_fraction,
            prefix_caching=args.prefix_caching,
            group=group,
            batch_invariant=args.batch_invariant,
        )
    except ValueError as e:  # the cache cannot hold one sequence of --max-len
        raise MoemeshError(
            f"{e}: lower --max-len, or give the cache more room (--gpu-memory-fraction, --kv-blocks)"
        ) from None


def _listening_socket(host: str, port: int):
    """A socket bound to host:port (as uvicorn binds one), or one line saying why it cannot be."""
    import socket

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "in use by another process" if e.errno == errno.EADDRINUSE else e.strerror or str(e)
        raise MoemeshError(f"--host {host} --port {port}: cannot listen there ({reason})") from None
    return sock


def _checked(params) -> None:
    from moemesh.errors import RequestError

    try:
        params.check()
    except RequestError as e:  # named as the command line spells it
        flag = "--" + {"max_tokens": "max-new-tokens", "top_p": "top-p"}.get(e.param, e.param)
        message = str(e)
        raise MoemeshError(
            flag + message.removeprefix(e.param) if message.startswith(e.param) else f"{flag}: {message}"
        ) from None


@contextlib.contextmanager
def _loaded(args: argparse.Namespace):
    """(model, tokenizer, tensor-parallel group) for generate and serve: the mesh first (it checks
    the number of processes and makes "cuda" this rank's GPU), the model sharded over it."""
    import torch
    import torch.distributed as dist

    from moemesh.config import device_for
    from moemesh.inference.generate import drawn_for_generation, load_for_generation, model_tokenizer
    from moemesh.parallel.mesh import init_mesh

    for flag in ("max_batch", "max_num_batched_tokens", "kv_blocks", "block_size"):
        value = getattr(args, flag)
        if value is not None and value < (2 if flag == "kv_blocks" else 1):
            raise MoemeshError(f"--{flag.replace('_', '-')} must be >= {2 if flag == 'kv_blocks' else 1}, got {value}")
    if args.packed_graph_tokens is not None and args.packed_graph_tokens < 0:
        raise MoemeshError(f"--packed-graph-tokens must be >= 0, got {args.packed_graph_tokens}")
    if args.max_len is not None and args.max_len < 2:
        raise MoemeshError(f"--max-len must be >= 2, got {args.max_len}")
    if not 0 < args.gpu_memory_fraction <= 1:
        raise MoemeshError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    device = device_for(args.device, "--device")
    # First the mesh: it checks the number of processes and makes "cuda" this rank's GPU.
    dims, whole_experts = _parallel_dims(args)
    mesh = init_mesh(dims)
    try:
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        if args.config is None:
            model, tokenizer = load_for_generation(
                args.checkpoint, args.tokenizer, device, dtype, mesh, args.adapter, whole_experts, args.quantize,
                args.dequantize,
            )  # fmt: skip
            if model.kept_quantized is not None and _is_rank_zero():
                print(f"moemesh {args.command}: {model.kept_quantized.describe(per_product=False)}", file=sys.stderr)
            if args.batch_invariant and model.kept_quantized is not None and model.kept_quantized.kept:
                raise MoemeshError("--batch-invariant does not cover quantized weights yet: add --dequantize")
        elif args.adapter is not None:
            raise MoemeshError("--adapter needs the --checkpoint of its base model, not --config")
        elif args.quantize is not None:
            raise MoemeshError("--quantize fp8 quantizes a --checkpoint's weights, not a --config's drawn ones")
        else:
            model, tokenizer = drawn_for_generation(args.config, device, dtype, mesh, whole_experts)
            if args.tokenizer is not None:
                tokenizer = model_tokenizer(args.tokenizer, model.config.vocab_size, "--tokenizer")
        yield model, tokenizer, mesh.group("ep" if mesh.dims.ep > 1 else "tp")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _parallel_dims(args: argparse.Namespace):
    """generate's and serve's layout: --tp or --ep (or --set parallel.tp=N / parallel.ep=N), or both
    of one size (tensor parallelism with whole experts) -> (the mesh's dims, whether its experts
    are whole)."""
    from moemesh.parallel.mesh import ParallelDims

    sizes = {"tp": args.tp, "ep": args.ep}
    for item in (item for group in args.overrides for item in group):
        key, _, value = item.partition("=")
        if key not in ("parallel.tp", "parallel.ep") or not value.isdigit():
            raise MoemeshError(
                f"{args.command} --set takes only parallel.tp=N or parallel.ep=N (the tensor- or expert-parallel "
                f"size), got {item!r}"
            )
        sizes[key.removeprefix("parallel.")] = int(value)
    for axis, size in sizes.items():
        if size < 1:
            raise MoemeshError(f"--{axis} must be >= 1, got {size}")
    if sizes["tp"] > 1 and sizes["ep"] > 1:
        if sizes["tp"] != sizes["ep"]:
            raise MoemeshError(
                f"{args.command} --tp N --ep N splits attention and experts over the same N ranks: give both one size "
                f"(got tp={sizes['tp']}, ep={sizes['ep']})"
            )
        return ParallelDims(tp=sizes["tp"]), True
    return ParallelDims(**sizes), False


def _estimate(args: argparse.Namespace) -> None:
    from moemesh.checkpoint.load import init_source
    from moemesh.config import load_config
    from moemesh.estimate import estimate_run

    if args.pp is not None and args.pp < 1:
        raise MoemeshError(f"--pp must be >= 1, got {args.pp}")
    overrides = [item for group in args.overrides for item in group]
    config = load_config(args.config, overrides, launched=False, init_source=init_source)
    print(estimate_run(config, args.pp, args.schedule, args.profile))


def _data(args: argparse.Namespace) -> None:
    from moemesh.checkpoint.load import init_source
    from moemesh.config import load_config
    from moemesh.data import show
    from moemesh.data.dataset import load_dataset

    if args.show < 0:
        raise MoemeshError(f"--show must be >= 0, got {args.show}")
    overrides = [item for group in args.overrides for item in group]
    config = load_config(args.config, overrides, launched=False, init_source=init_source)
    train = config.train
    dataset, tokenizer = load_dataset(config.data, train.seq_len, train.seed, config.model.vocab_size)
    if args.show:
        colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print(show.render(tokenizer, show.sequences(dataset, args.show), colour))
    print(f"{config.data.path} (tokenizer {config.data.tokenizer}): {show.counts(dataset)}")
    if args.output:
        written = show.write_jsonl(dataset, Path(args.output))
        print(f"wrote {written} sequences to {args.output}")


def _convert(args: argparse.Namespace) -> None:
    import torch

    from moemesh.checkpoint.adapters import PEFT_CONFIG, is_lora_checkpoint
    from moemesh.checkpoint.convert import export_adapter, export_hf, export_merged, export_quantized, import_hf
    from moemesh.checkpoint.load import is_hf_directory

    dtype = getattr(torch, args.dtype) if args.dtype else None
    adapter = (Path(args.source) / PEFT_CONFIG).is_file() or is_lora_checkpoint(args.source)
    if (args.merge or args.base) and not adapter:
        raise MoemeshError(f"--merge and --base take a LoRA run or a PEFT adapter, and {args.source} is neither")
    if args.base and not args.merge:
        raise MoemeshError("--base goes with --merge")
    if args.quantize and adapter and not args.merge:
        raise MoemeshError(f"--quantize takes a model, and {args.source} holds LoRA adapters (add --merge)")
    if args.merge:
        base = export_merged(args.source, args.target, args.base, dtype, args.quantize)
        quantized = f" ({args.quantize})" if args.quantize else ""
        merged = f"{base or 'the seed weights'} merged with {args.source}"
        print(f"wrote Hugging Face directory {args.target}{quantized}: {merged}")
    elif args.quantize:
        source = export_quantized(args.source, args.target, args.quantize, dtype)
        print(f"wrote Hugging Face directory {args.target} ({args.quantize}) from {source}")
    elif adapter:
        if (Path(args.source) / PEFT_CONFIG).is_file():
            raise MoemeshError(f"{args.source} is a PEFT adapter already (--merge writes it merged into its base)")
        checkpoint = export_adapter(args.source, args.target)
        print(f"wrote PEFT adapter directory {args.target} from {checkpoint}")
    elif is_hf_directory(args.source):
        import_hf(args.source, args.target, dtype)
        print(f"wrote moemesh checkpoint {args.target}")
    else:
        checkpoint = export_hf(args.source, args.target, dtype)
        print(f"wrote Hugging Face directory {args.target} from {checkpoint}")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun sets RANK; one process has none


def _say(line: str) -> None:
    """Print `line` on standard error, and give it to torchrun's report of this rank's failure."""
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # as torchelastic's ErrorHandler writes it; torchrun shows "py_callstack"
        with open(error_file, "w") as f:
            json.dump(
                {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}},
                f,
            )


def _say_once(line: str) -> None:
    """`_say` from rank 0 only, for a mistake that every rank meets alike."""
    if _is_rank_zero():
        _say(line)
    else:  # rank 0 meets it at the same moment; had this rank exited first, torchrun could stop rank 0 unsaid
        time.sleep(_QUIET_RANK_DELAY_S)


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: leave without the C++ teardown
        # Once in some 30 two-process runs, a rank that had finished died in the interpreter's
        # teardown with "terminate called without an active exception" (a communication thread
        # still joinable when its owner was destroyed): SIGABRT, and torchrun then killed the other
        # rank mid-way through its last writes. Everything is written and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# What to change when a command runs out of GPU memory (after the allocator's own message).
_MEMORY_ADVICE = {
    "train": "lower train.micro_batch or train.seq_len, or spread the model over more GPUs (parallel.ep, "
    "parallel.dp_shard, parallel.pp); `moemesh estimate` with the same config predicts each GPU's memory",
    "generate": "lower --gpu-memory-fraction, --max-num-batched-tokens or --max-len, or split the model with --tp",
    "serve": "lower --gpu-memory-fraction, --max-num-batched-tokens or --max-len, or split the model with --tp",
}


# The allocator's setting for the inference commands, unless the user gave one: a decoding engine
# holds the weights, then a KV pool sized to what is left, then each packed step's temporaries, which
# fixed-size segments fragment. On one H200, gpt-oss-120b in MXFP4 ran out of memory prefilling 64
# prompts with 17 GiB reserved but unallocated, and ran with expandable segments (bench/serve/decode.py,
# 2026-12-03; every decode figure of that day was measured with them).
INFERENCE_ALLOCATOR = "expandable_segments:True"


def inference_allocator(environ=os.environ) -> None:
    """Expandable segments for torch's CUDA allocator, where neither of its variables is set (read
    when CUDA is first used, so before any model is built)."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = INFERENCE_ALLOCATOR


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("generate", "serve"):
        inference_allocator()
    run = {
        "train": _train,
        "generate": _generate,
        "serve": _serve,
        "data": _data,
        "estimate": _estimate,
        "convert": _convert,
    }[args.command]
    try:
        run(args)
    except MoemeshError as e:
        _say_once(f"moemesh {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:
        print(f"moemesh {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from moemesh.parallel.comm import peer_failure

        if type(e).__name__ == "OutOfMemoryError":  # torch's, without importing torch here
            _say(
                f"moemesh {args.command}: error: rank {os.environ.get('RANK', '0')}: out of GPU memory "
                f"({str(e).splitlines()[0].rstrip('.')}); {_MEMORY_ADVICE.get(args.command, '')}"
            )
            return 1
        reason = peer_failure(e)
        if reason is None:
            raise
        # Every rank that waited on the failed peer says so: which rank saw what tells where it failed.
        _say(
            f"moemesh {args.command}: error: rank {os.environ.get('RANK', '0')}: a collective failed: {reason} "
            "(a peer stopped, died or exceeded parallel.timeout_s)"
        )
        return 1
    return 0
