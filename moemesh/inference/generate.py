"""Generation for many prompts at once: `generate` runs them through the decode engine and the
scheduler (continuous batching), each with its own settings and stops, and returns them in
order; `read_prompts` reads them from a file. `load_for_generation` is the one way the engine,
`moemesh generate` and `moemesh serve` get a model and its tokenizer (`drawn_for_generation`:
a config's model with weights drawn from its seed, for measuring before a checkpoint exists).

A prompt's text is preceded by the end-of-document token, as a document is in training, so that
it reads as the start of a document.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path

import torch

from moemesh.checkpoint.adapters import read_adapter
from moemesh.checkpoint.load import init_source, load_weights
from moemesh.checkpoint.quantized_base import keep_for_inference
from moemesh.config import load_config
from moemesh.data.sources import jsonl_values
from moemesh.data.tokenizer import Tokenizer, load_tokenizer
from moemesh.errors import ConfigError, DataError, RequestError
from moemesh.inference.engine import DecodeEngine
from moemesh.inference.request import SamplingParams, Sequence, prompt_ids
from moemesh.inference.scheduler import Scheduler
from moemesh.models import MoECausalLM
from moemesh.models.build import meta_model
from moemesh.models.lora import merge_adapters
from moemesh.parallel.config import ParallelConfig, StepShape
from moemesh.parallel.expert import apply_ep_for_decoding
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.parallelize import materialize, parallelize
from moemesh.parallel.tensor import apply_tp_whole_experts


def load_for_generation(
    path: str | os.PathLike,
    tokenizer: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    mesh: Mesh | None = None,
    adapter: str | os.PathLike | None = None,
    whole_experts: bool = False,
    quantize: str | None = None,
    dequantize: bool = False,
) -> tuple[MoECausalLM, Tokenizer]:
    """A model from a checkpoint, run directory or Hugging Face directory, laid out for `mesh`
    (tensor parallelism: each rank reads only its heads, expert slices and vocabulary slice; with
    `whole_experts`, E/tp whole experts instead of slices of all: `apply_tp_whole_experts`) and
    read straight into `dtype` on `device` (default bfloat16 on a GPU, float32 on a CPU), with its
    tokenizer: the one named, else the directory's tokenizer.json, else bytes. `adapter`: LoRA
    adapters (a PEFT directory or a LoRA run), laid out with their base, merged into its weights
    (each rank its shard, in fp32) and dropped: decoding then runs the base's kernels.

    Quantized weights: the weights a Hugging Face checkpoint stores in block FP8 or MXFP4 stay in
    their codes and scales (QuantizedWeights of each rank's block, `keep_for_inference`), read as
    they are by the decoding kernels and dequantized per product elsewhere; `quantize="fp8"`
    quantizes a dense checkpoint's projections and expert banks at load (128 x 128 tiles, the
    published rule); `dequantize` reads every weight dense in `dtype` instead (as with adapters,
    which merge into dense weights). The model's `kept_quantized` says what was kept (None:
    nothing)."""
    config, found = init_source(path)
    if tokenizer is None and found is None:  # no tokenizer anywhere: bytes, for a model of any vocabulary
        tokenizer = load_tokenizer("bytes")  # (one smaller than 256 takes token-id prompts)
    else:
        name, origin = (tokenizer, "--tokenizer") if tokenizer is not None else (str(found), "the checkpoint's")
        tokenizer = model_tokenizer(name, config.vocab_size, origin)  # before the weights are read
    if adapter is not None:
        adapter = read_adapter(adapter, config)
    if quantize is not None and (dequantize or adapter is not None):
        raise ConfigError(
            f"--quantize {quantize} keeps weights quantized: not with "
            f"{'--dequantize' if dequantize else '--adapter (merged into dense weights)'}"
        )
    model = _laid_out(config, device, dtype, mesh, adapter, whole_experts)
    kept = None
    if not dequantize and adapter is None:  # frozen inference weights, kept in their codes
        model.requires_grad_(False)
        kept = keep_for_inference(model, path, torch.device(device), quantize)
    materialize(model, device)
    load_weights(model, path, mesh)
    model.kept_quantized = kept
    if adapter is not None:
        adapter.load_into(model)
        merge_adapters(model)
    return model.eval(), tokenizer


def model_tokenizer(name: str, vocab_size: int, origin: str) -> Tokenizer:
    """The tokenizer `name` (where it came from: `origin`), refused in one line when it has more
    tokens than the model's vocabulary: its ids past the embedding would fail only at a prompt."""
    tokenizer = load_tokenizer(name)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"the tokenizer {name} ({origin}) has {tokenizer.vocab_size} tokens, more than the model's "
            f"vocab_size {vocab_size}: its ids from {vocab_size} on have no embedding (name the model's own "
            "tokenizer with --tokenizer)"
        )
    return tokenizer


def drawn_for_generation(
    config_path: str | os.PathLike,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    mesh: Mesh | None = None,
    whole_experts: bool = False,
) -> tuple[MoECausalLM, Tokenizer]:
    """The model of a moemesh config, laid out for `mesh` as `load_for_generation` lays it out, each
    rank drawing only its shard from the config's train.seed (no rank holds the whole model), with
    the config's data.tokenizer. Its answers are noise: this is for measuring a model's speed and
    memory, served or not, before a checkpoint of it exists (Qwen3-235B-A22B is 470 GB in bf16)."""
    run = load_config(config_path, launched=False)
    tokenizer = model_tokenizer(run.data.tokenizer, run.model.vocab_size, "data.tokenizer")
    model = materialize(_laid_out(run.model, device, dtype, mesh, None, whole_experts), device, seed=run.train.seed)
    return model.eval(), tokenizer


def _laid_out(
    config, device, dtype: torch.dtype | None, mesh: Mesh | None, adapter=None, whole_experts: bool = False
) -> MoECausalLM:
    """The model on meta in `dtype` (default bfloat16 on a GPU, float32 on a CPU), its adapters
    attached, laid out for `mesh`'s tensor or expert parallelism (tensor parallelism with its
    experts whole where `whole_experts`)."""
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    model = meta_model(config, dtype)
    if adapter is not None:
        adapter.attach(model, torch.float32)
    if mesh is not None and mesh.dims.ep > 1:  # this rank's experts, the rest whole
        apply_ep_for_decoding(model, mesh)
    elif mesh is not None and whole_experts and mesh.dims.tp > 1:
        apply_tp_whole_experts(model, mesh)
    elif mesh is not None:
        step = StepShape(dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
        parallelize(model, mesh, ParallelConfig(tp=mesh.dims.tp), step)
    return model


def generate(
    engine: DecodeEngine,
    tokenizer: Tokenizer,
    prompts: Seq[str | list[int]],
    params: SamplingParams | Seq[SamplingParams] | None = None,
) -> list[Sequence]:
    """Every prompt (text, or token ids taken as they are) continued, in the order given; one
    SamplingParams for all or one per prompt. Each result has `text`, `token_ids` and
    `finish_reason` ("stop": the end-of-document token or a stop string, "length")."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    scheduler = Scheduler(engine, tokenizer, max_waiting=len(prompts))
    sequences = [
        scheduler.submit(p if isinstance(p, list) else prompt_ids(tokenizer, p), q)
        for p, q in zip(prompts, params, strict=True)
    ]
    scheduler.run_until_idle()
    return sequences


_PER_PROMPT = ("max_tokens", "temperature", "top_p", "seed", "stop")


def read_prompts(path: str | os.PathLike, defaults: SamplingParams) -> list[tuple[int, str, SamplingParams]]:
    """(line number, prompt, settings) of each prompt of a file. A `.jsonl` file: one JSON object
    a line, {"prompt": ...} with optional max_tokens, temperature, top_p, seed and stop (a string
    or a list) that override `defaults`; its blank lines hold no object and are skipped. Any other
    file: every line is a prompt, as written — an empty line or one of spaces too (an empty prompt
    starts a document) — so that the outputs match the lines one to one. Lines end at "\n" (or
    "\r\n") alone: a form feed is a character of a prompt, as in Python's sources."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read prompts file {path}: {e}") from None
    if path.suffix != ".jsonl":
        lines = text.removesuffix("\n").split("\n") if text else []
        prompts = [(number, line.removesuffix("\r"), defaults) for number, line in enumerate(lines, start=1)]
    else:
        prompts = [(number, *_prompt_line(path, number, item, defaults)) for number, item in jsonl_values(path, text)]
    if not prompts:
        raise DataError(f"prompts file {path} has no prompt")
    return prompts


def _prompt_line(path: Path, number: int, item, defaults: SamplingParams) -> tuple[str, SamplingParams]:
    if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
        raise DataError(f'{path} line {number}: expected an object with a string "prompt"')
    unknown = set(item) - {"prompt", *_PER_PROMPT}
    if unknown:
        raise DataError(
            f"{path} line {number}: unknown field {sorted(unknown)[0]!r} (known: prompt, {', '.join(_PER_PROMPT)})"
        )
    settings = {k: item[k] for k in _PER_PROMPT if k in item}
    if isinstance(settings.get("stop"), (str, list)):
        settings["stop"] = (settings["stop"],) if isinstance(settings["stop"], str) else tuple(settings["stop"])
    params = replace(defaults, **settings)
    try:
        params.check()
    except RequestError as e:
        raise DataError(f"{path} line {number}: {e}") from None
    return item["prompt"], params
