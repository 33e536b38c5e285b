"""The `moemesh` command: train, generate, estimate, convert.

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
import json
import math
import os
import sys
import time

from moemesh.errors import MoemeshError

_DTYPE_NAMES = ("float32", "bfloat16", "float16")
_QUIET_RANK_DELAY_S = 1.0


class _Parser(argparse.ArgumentParser):
    """One line for bad arguments (argparse's own prints its usage first), from rank 0 only."""

    def error(self, message: str):
        _say_once(f"{self.prog}: error: {message}")
        self.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="moemesh", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model (default: configs/tiny.toml on the stdlib corpus)")
    train.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    train.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.steps=100 model.num_experts=16")

    generate = commands.add_parser("generate", help="continue a prompt with a trained model")
    generate.add_argument("--checkpoint", required=True,
                          help="checkpoint directory, run directory (newest checkpoint) or Hugging Face directory")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=200,
                          help="stops earlier at the end-of-document token or at the model's max_position_embeddings")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--tokenizer", help="'bytes' or a tokenizer.json (default: the checkpoint's, else bytes)")
    generate.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    generate.add_argument("--tp", type=int, default=1,
                          help="tensor-parallel ranks, launched as `torchrun --nproc-per-node N -m moemesh "
                               "generate ... --tp N`: every rank loads the whole model and keeps its shard "
                               "(attention heads and their KV cache, expert slices, vocabulary); rank 0 prints")
    generate.add_argument("--set", dest="overrides", action="append", nargs="+", default=[],
                          metavar="parallel.tp=N", help="the same as --tp N, spelled as for `moemesh train`")

    estimate = commands.add_parser("estimate", help="per-layer memory and time, pipeline stages, per-rank memory")
    estimate.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    estimate.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                          help="override a config value, as for `moemesh train`")
    estimate.add_argument("--pp", type=int, help="pipeline ranks (default: parallel.pp)")
    estimate.add_argument("--schedule", choices=("dualpipev", "1f1b"), help="default: parallel.pp_schedule")
    estimate.add_argument("--profile", action="store_true",
                          help="measure each layer (one forward and backward on random tokens, on the "
                               "config's device) instead of the analytical estimate")

    convert = commands.add_parser("convert", help="Hugging Face directory <-> moemesh checkpoint (direction from SRC)")
    convert.add_argument("source", metavar="SRC", help="Hugging Face directory, checkpoint or run directory")
    convert.add_argument("target", metavar="DST", help="new directory to write")
    convert.add_argument("--dtype", choices=_DTYPE_NAMES,
                         help="weight dtype of a written Hugging Face directory (default float32)")
    return parser


def _train(args: argparse.Namespace) -> None:
    from moemesh.config import load_config
    from moemesh.train.trainer import train

    overrides = [item for group in args.overrides for item in group]
    train(load_config(args.config, overrides))


def _generate(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from moemesh.config import device_for
    from moemesh.inference.generate import complete, load_for_generation
    from moemesh.parallel.mesh import ParallelDims, init_mesh
    from moemesh.parallel.tensor import apply_tp

    _check_generate_arguments(args)
    device = device_for(args.device, "--device")
    # First the mesh: it checks the number of processes and makes "cuda" this rank's GPU.
    mesh = init_mesh(ParallelDims(tp=_tensor_parallel_size(args)))
    try:
        model, tokenizer = load_for_generation(args.checkpoint, args.tokenizer, device)
        apply_tp(model, mesh)
        text = complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed)
        if mesh.rank("tp") == 0:
            print(args.prompt + text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_generate_arguments(args: argparse.Namespace) -> None:
    """One message per argument at fault, before anything is loaded."""
    if args.max_new_tokens < 1:
        raise MoemeshError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise MoemeshError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:  # false for nan too
        raise MoemeshError(f"--top-p must be in (0, 1], got {args.top_p}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # the shell passed bytes that are not UTF-8 (kept as surrogates)
        raise MoemeshError(f"--prompt is not UTF-8 text (a byte such as 0x{ord(e.object[e.start]) & 0xff:02x} at "
                           f"character {e.start} is not valid UTF-8)") from None


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    tp = args.tp
    for item in (item for group in args.overrides for item in group):
        key, _, value = item.partition("=")
        if key != "parallel.tp" or not value.isdigit():
            raise MoemeshError(f"generate --set takes only parallel.tp=N (the tensor-parallel size), got {item!r}")
        tp = int(value)
    if tp < 1:
        raise MoemeshError(f"--tp must be >= 1, got {tp}")
    return tp


def _estimate(args: argparse.Namespace) -> None:
    from moemesh.config import load_config
    from moemesh.estimate import estimate_run

    if args.pp is not None and args.pp < 1:
        raise MoemeshError(f"--pp must be >= 1, got {args.pp}")
    overrides = [item for group in args.overrides for item in group]
    print(estimate_run(load_config(args.config, overrides), args.pp, args.schedule, args.profile))


def _convert(args: argparse.Namespace) -> None:
    import torch

    from moemesh.checkpoint.convert import export_hf, import_hf, is_hf_directory

    if is_hf_directory(args.source):
        import_hf(args.source, args.target)
        print(f"wrote moemesh checkpoint {args.target}")
    else:
        checkpoint = export_hf(args.source, args.target, getattr(torch, args.dtype) if args.dtype else None)
        print(f"wrote Hugging Face directory {args.target} from {checkpoint}")


def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"  # torchrun sets RANK; one process has none


def _say(line: str) -> None:
    """Print `line` on standard error, and give it to torchrun's report of this rank's failure."""
    print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # as torchelastic's ErrorHandler writes it; torchrun shows "py_callstack"
        with open(error_file, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                  "timestamp": str(int(time.time()))}}}, f)


def _say_once(line: str) -> None:
    """`_say` from rank 0 only, for a mistake that every rank meets alike."""
    if _is_rank_zero():
        _say(line)
    else:  # rank 0 meets it at the same moment; had this rank exited first, torchrun could stop rank 0 unsaid
        time.sleep(_QUIET_RANK_DELAY_S)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {"train": _train, "generate": _generate, "estimate": _estimate, "convert": _convert}[args.command]
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

        reason = peer_failure(e)
        if reason is None:
            raise
        # Every rank that waited on the failed peer says so: which rank saw what tells where it failed.
        _say(f"moemesh {args.command}: error: rank {os.environ.get('RANK', '0')}: a collective failed: {reason} "
             "(a peer stopped, died or exceeded parallel.timeout_s)")
        return 1
    return 0
