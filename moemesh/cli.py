"""The `moemesh` command: train, generate, estimate, convert.

A mistake in what the user gave (config, data, checkpoint) prints one line and exits with code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from moemesh.errors import MoemeshError

_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train a model (default: configs/tiny.toml on the stdlib corpus)")
    train.add_argument("--config", help="TOML config file (default: configs/tiny.toml)")
    train.add_argument("--set", dest="overrides", action="append", nargs="+", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set train.steps=100 model.num_experts=16")

    generate = commands.add_parser("generate", help="continue a prompt with a trained model")
    generate.add_argument("--checkpoint", required=True,
                          help="checkpoint directory, run directory (newest checkpoint) or Hugging Face directory")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--tokenizer", help="'bytes' or a tokenizer.json (default: the checkpoint's, else bytes)")
    generate.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    generate.add_argument("--tp", type=int, default=1,
                          help="tensor-parallel ranks, launched as `torchrun --nproc-per-node N -m moemesh "
                               "generate ... --tp N`: each rank reads only its shard "
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
    import torch
    import torch.distributed as dist

    from moemesh.inference.generate import complete, load_for_generation
    from moemesh.parallel.mesh import ParallelDims, init_mesh

    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        raise MoemeshError("need --max-new-tokens >= 1, --temperature >= 0 and 0 < --top-p <= 1")
    # First the mesh: it checks the number of processes and makes "cuda" this rank's GPU.
    mesh = init_mesh(ParallelDims(tp=_tensor_parallel_size(args)))
    try:
        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = load_for_generation(args.checkpoint, args.tokenizer, device, mesh=mesh)
        text = complete(model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed)
        if mesh.rank("tp") == 0:
            print(args.prompt + text)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _tensor_parallel_size(args: argparse.Namespace) -> int:
    tp = args.tp
    for item in (item for group in args.overrides for item in group):
        key, _, value = item.partition("=")
        if key != "parallel.tp" or not value.isdigit():
            raise MoemeshError(f"generate --set takes only parallel.tp=N (the tensor-parallel size), got {item!r}")
        tp = int(value)
    return tp


def _estimate(args: argparse.Namespace) -> None:
    from moemesh.config import load_config
    from moemesh.estimate import estimate_run

    overrides = [item for group in args.overrides for item in group]
    print(estimate_run(load_config(args.config, overrides, launched=False), args.pp, args.schedule, args.profile))


def _convert(args: argparse.Namespace) -> None:
    import torch

    from moemesh.checkpoint.convert import export_hf, import_hf
    from moemesh.checkpoint.load import is_hf_directory

    if is_hf_directory(args.source):
        import_hf(args.source, args.target)
        print(f"wrote moemesh checkpoint {args.target}")
    else:
        checkpoint = export_hf(args.source, args.target, getattr(torch, args.dtype) if args.dtype else None)
        print(f"wrote Hugging Face directory {args.target} from {checkpoint}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    run = {"train": _train, "generate": _generate, "estimate": _estimate, "convert": _convert}[args.command]
    try:
        run(args)
    except MoemeshError as e:
        print(f"moemesh {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moemesh {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0
