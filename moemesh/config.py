"""The run configuration: a TOML file plus `--set section.key=value` overrides, checked into
dataclasses. Sections: `model` (Hugging Face config.json field names, becomes a ModelConfig),
`parallel` (a ParallelConfig, `parallel/config.py`), `train`, `data` and `lora` (adapters,
`models/lora.py`). Every mistake raises
ConfigError naming the key at fault."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moemesh.errors import ConfigError
from moemesh.models import ModelConfig
from moemesh.models.family import family
from moemesh.models.lora import LoraConfig
from moemesh.parallel.config import ParallelConfig, StepShape
from moemesh.parallel.expert import DISPATCHERS
from moemesh.parallel.pipeline.schedule import min_micro_batches

# `moemesh train` with no --config: the tiny model of this checkout.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps
    seed: int = 0  # initial weights and data order
    run_dir: str = "runs/default"  # where metrics, plot, config and checkpoints go
    global_batch: int = 16  # sequences per optimizer step, whatever the layout
    micro_batch: int = 8  # sequences per forward/backward, summed over the data-parallel ranks
    seq_len: int = 256  # tokens per sequence; at most model.max_position_embeddings
    lr: float = 1e-3  # peak learning rate of AdamW
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 20  # linear warmup, then cosine decay
    weight_decay: float = 0.1  # AdamW decay of matrices (not of norms and biases)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW betas
    grad_clip: float = 1.0  # global gradient-norm limit; 0 turns clipping off
    router_bias_update_rate: float = 0.001  # DeepSeek-V3's expert-bias step per optimizer step; 0: off
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU (autocast; weights stay fp32)
    param_dtype: str = "float32"  # weights and AdamW state; "bfloat16": all bf16, half the memory
    # What a decoder layer keeps for backward: "none" (everything), "full" (its input; the layer runs
    # again in backward), "selective" (matmul and collective outputs; norms, activations and
    # attention's softmax run again). The gradients are the same bit for bit.
    activation_checkpointing: str = "none"
    # A micro-batch's forward and backward as one CUDA graph, captured at the first step
    # (train/cuda_graph.py): the host's kernel launches go. One GPU, or expert parallelism alone
    # (then the whole step is one graph, collectives included); bf16, no LoRA dropout.
    cuda_graphs: bool = False
    device: str = "auto"  # auto: cuda when available, else cpu
    threads: int = 0  # CPU runs: compute threads; 0: OMP_NUM_THREADS if set, else the cores idle at the start
    resume: bool = False  # continue from the newest checkpoint of run_dir that verifies
    overwrite: bool = False  # start afresh in a run_dir that holds checkpoints, deleting them
    # Start from these weights (fresh optimizer, step 0): a Hugging Face directory, or a moemesh
    # checkpoint or run directory. The model is the one its config.json describes; "" : from the seed.
    init_from: str = ""
    save_every: int = 100  # 0: only the final checkpoint; -1: none (benchmark runs)
    keep_checkpoints: int = 3  # the newest ones kept after each save; 0: keep every one
    max_bad_steps: int = 3  # non-finite loss or gradient norm this many steps in a row stops the run
    eval_every: int = 50  # 0: evaluate only before the first and after the last step
    eval_sequences: int = 64  # validation sequences per evaluation (always the same ones)
    log_every: int = 10  # steps between plain progress lines when the output is not a terminal
    # Where else the scalars of metrics.jsonl go, step by step: any of REPORT_TO (train/report.py).
    report_to: list[str] = field(default_factory=list)

    @property
    def step_shape(self) -> StepShape:
        """What the parallel layout depends on of a step (`train.dtype` resolved)."""
        return StepShape(
            self.global_batch // self.micro_batch,
            self.micro_batch,
            self.seq_len,
            self.dtype,
            self.param_dtype,
            self.activation_checkpointing,
            whole_step=self.cuda_graphs,
        )


# train.report_to's names -> the package each needs (`pip install 'moemesh[tracking]'` installs both).
REPORT_TO = {"tensorboard": "tensorboard", "wandb": "wandb"}


@dataclass
class DataConfig:
    path: str = "stdlib"  # "stdlib", a text/JSONL/.npy/.bin file, or a directory of text/JSONL files
    tokenizer: str = "bytes"  # "bytes" or a tokenizer.json file
    val_fraction: float = 0.05  # the tail of the token stream (of a chat file: of its rows) held out for validation
    # How a JSONL file's rows read: "auto" (from the first row's keys), "text" ({"text": ...}, one
    # stream as a text file), "messages" (OpenAI chat), "sharegpt" ("conversations" of from/value),
    # "prompt_completion" or "alpaca" (instruction/input/output): all but text are packed by row
    format: str = "auto"
    chat_template: str = ""  # a Jinja file to render conversations with ("": the tokenizer's template)
    # A conversation's trained tokens: "assistant" (each reply with its end of turn), "last_assistant", "all"
    train_on: str = "assistant"
    too_long: str = "drop"  # a row longer than train.seq_len: "drop", "truncate" (its end) or "error"


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Why data.tokenizer is what it is, said when a run starts; not part of the config itself.
    tokenizer_origin: str = field(default="the default", compare=False)

    @property
    def step_shape(self) -> StepShape:
        """What the parallel layout depends on of a step (`train.dtype` resolved), LoRA's frozen base
        included, and the format it is kept in when the model's config.json (or the run config's
        [model.quantization_config]) names one."""
        method = (self.model.extra.get("quantization_config") or {}).get("quant_method", "")
        quantized = {"fp8": "fp8", "compressed-tensors": "fp8", "mxfp4": "mxfp4"}.get(method, "")
        kept = quantized if self.lora.enabled and self.lora.keep_quantized else ""
        return dataclasses.replace(self.train.step_shape, frozen_base=self.lora.enabled, quantized_base=kept)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        model = {name: getattr(self.model, name) for name in ModelConfig.field_names()}
        return {
            "model": {k: v for k, v in model.items() if v is not None},
            "parallel": dataclasses.asdict(self.parallel),
            "train": dataclasses.asdict(self.train),
            "data": dataclasses.asdict(self.data),
            "lora": dataclasses.asdict(self.lora),
        }

    def to_toml(self) -> str:
        return dumps_toml(self.to_dict())


def device_for(name: str, key: str) -> str:
    """The device `name` ("auto", "cpu", "cuda", "cuda:N") stands for on this machine; ConfigError
    naming `key` (the config key or option that gave it) when there is no such device."""
    _check_device_name(name, key)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} but torch sees no GPU")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"{key}={name!r} but torch sees {torch.cuda.device_count()} GPU(s)")
    return name


def _check_device_name(name: str, key: str) -> None:
    kind, colon, index = name.partition(":")
    if name != "auto" and (kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not index.isdigit()))):
        raise ConfigError(f"{key} must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")


def resolve_device(config: RunConfig) -> RunConfig:
    """Replace train.device / train.dtype "auto" by what this machine has."""
    train = config.train
    device = device_for(train.device, "train.device")
    dtype = train.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    train.device, train.dtype = device, dtype
    return config


_SECTIONS = {"parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig, "lora": LoraConfig}


# Reads what `train.init_from` brings (`checkpoint.load.init_source`): its model config and tokenizer.json.
InitSource = Callable[[str], tuple[ModelConfig, Path | None]]


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] = (),
    launched: bool = True,
    init_source: InitSource | None = None,
) -> RunConfig:
    """Read `path` (the default config when None), apply `section.key=value` overrides, check
    (with `launched`, also that torchrun started the processes the layout needs). A run with
    `train.init_from` needs `init_source` (`moemesh.checkpoint.load.init_source`) to read the
    checkpoint's model: this layer sits above `checkpoint/` and imports none of it."""
    if path is None and not DEFAULT_CONFIG.is_file():
        raise ConfigError(
            f"no --config given, and the default {DEFAULT_CONFIG} is missing: moemesh was "
            "installed without its source checkout; pass --config FILE"
        )
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    overridden = {item.partition("=")[0].strip() for item in overrides}
    if path == DEFAULT_CONFIG and "train.init_from" in overridden:
        raw.pop("model", None)  # the default's tiny model is not the one a checkpoint brings
    # The tokenizer a file names is chosen for the checkpoint that file names: with init_from set
    # on the command line, the file's is a default (configs/*.toml say "bytes"), the checkpoint's wins.
    tokenizer_chosen = "data.tokenizer" in overridden or (
        "tokenizer" in raw.get("data", {}) and "init_from" in raw.get("train", {})
    )
    for item in overrides:
        _apply_override(raw, item)
    return config_from_dict(raw, launched, init_source, tokenizer_chosen)


def config_from_dict(
    raw: dict[str, Any],
    launched: bool = True,
    init_source: InitSource | None = None,
    tokenizer_chosen: bool | None = None,
) -> RunConfig:
    """The checked RunConfig of a raw TOML dict. `init_source` reads train.init_from's model and
    tokenizer (see load_config). `tokenizer_chosen`: whether data.tokenizer was chosen for this
    run, so that it overrides train.init_from's tokenizer (None: whenever the dict has one)."""
    sections = ["model", *_SECTIONS]
    for key, value in raw.items():
        if key not in sections and isinstance(value, dict):
            close = difflib.get_close_matches(key, sections, n=1)
            hint = f" (did you mean [{close[0]}]?)" if close else ""
            raise ConfigError(f"unknown config section [{key}]{hint}; sections: {', '.join(sections)}")
        if key not in sections:
            _unknown_key(key)  # a key outside any section, such as `steps = 3`
        if not isinstance(value, dict):
            raise ConfigError(f"config section [{key}] must be a table, got {value!r}")
    built = {name: _build_section(name, cls, raw.get(name, {})) for name, cls in _SECTIONS.items()}
    if tokenizer_chosen is None:
        tokenizer_chosen = "tokenizer" in raw.get("data", {})
    tokenizer_origin = "data.tokenizer" if "tokenizer" in raw.get("data", {}) else "the default"
    if built["train"].init_from:
        if init_source is None:
            raise ValueError("train.init_from is set: pass init_source=moemesh.checkpoint.load.init_source")
        source_model, tokenizer = init_source(built["train"].init_from)
        model = _model_of(source_model, built["train"].init_from, raw.get("model", {}))
        if tokenizer is not None and not tokenizer_chosen:
            built["data"].tokenizer, tokenizer_origin = str(tokenizer), "train.init_from's"
        elif tokenizer is not None and built["data"].tokenizer != str(tokenizer):
            tokenizer_origin = f"data.tokenizer, not train.init_from's {tokenizer}"
        elif tokenizer is None and not tokenizer_chosen:
            tokenizer_origin = "the default: train.init_from has no tokenizer.json"
    else:
        model = _build_model(raw.get("model", {}))
    config = RunConfig(model=model, **built, tokenizer_origin=tokenizer_origin)
    _validate(config)
    if launched:
        _check_layout_available(config.parallel)
    return config


# [model] keys a run starting from a checkpoint may set: how it trains, not what the model is.
TRAINING_KEYS = ("output_router_logits", "router_aux_loss_coef")


def _model_of(model: ModelConfig, source: str, given: dict[str, Any]) -> ModelConfig:
    """The model of `train.init_from`'s config.json (`model`, read); a [model] key of the run may
    repeat it, or set one of TRAINING_KEYS, not contradict it."""
    names = ModelConfig.field_names()
    for key in given:
        if key not in names and key not in family(model.model_type).renames:
            _unknown_key(f"model.{key}", [f"model.{name}" for name in names])
    # The run's keys read as config.json's (a family's own spellings included), over the source's.
    source_hf, spelled = model.to_hf_dict(), family(model.model_type).write_renames
    given_hf = {spelled.get(key, key): value for key, value in given.items()}
    model, ours = ModelConfig.from_hf_dict(source_hf), ModelConfig.from_hf_dict({**source_hf, **given_hf})
    for name in names:
        if name not in TRAINING_KEYS and getattr(ours, name) != getattr(model, name):
            raise ConfigError(
                f"model.{name} = {getattr(ours, name)!r} contradicts train.init_from {source}, whose "
                f"config.json has {name} = {getattr(model, name)!r} (leave it out of [model])"
            )
    return ours


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    section, dot, name = key.partition(".")
    if not sep or not dot or not name:
        raise ConfigError(f"--set expects SECTION.KEY=VALUE, got {item!r}")
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as a path: take it as a string
    raw.setdefault(section, {})[name] = value


def _all_keys() -> list[str]:
    keys = [f"model.{name}" for name in ModelConfig.field_names()]
    for section, cls in _SECTIONS.items():
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return keys


# What other trainers call a key (transformers' TrainingArguments, Axolotl, torchtitan, nanoGPT),
# for the hint of an unknown one: spelling alone would take `learning_rate` to `min_lr_ratio`.
OTHER_NAMES = {
    "learning_rate": "train.lr",
    "max_lr": "train.lr",
    "lr_warmup_steps": "train.warmup_steps",
    "num_warmup_steps": "train.warmup_steps",
    "warmup_iters": "train.warmup_steps",
    "batch_size": "train.global_batch",
    "total_batch_size": "train.global_batch",
    "global_batch_size": "train.global_batch",
    "micro_batch_size": "train.micro_batch",
    "per_device_train_batch_size": "train.micro_batch",
    "local_batch_size": "train.micro_batch",
    "max_steps": "train.steps",
    "training_steps": "train.steps",
    "max_iters": "train.steps",
    "num_steps": "train.steps",
    "max_seq_length": "train.seq_len",
    "max_length": "train.seq_len",
    "sequence_len": "train.seq_len",
    "seq_length": "train.seq_len",
    "block_size": "train.seq_len",
    "max_grad_norm": "train.grad_clip",
    "output_dir": "train.run_dir",
    "resume_from_checkpoint": "train.resume",
    "save_steps": "train.save_every",
    "eval_steps": "train.eval_every",
    "logging_steps": "train.log_every",
    "model_name_or_path": "train.init_from",
    "base_model": "train.init_from",
    "num_threads": "train.threads",
    "dataset": "data.path",
    "datasets": "data.path",
}


def _unknown_key(key: str, candidates: list[str] | None = None) -> typing.NoReturn:
    candidates = candidates if candidates is not None else _all_keys()
    other = OTHER_NAMES.get(key.rpartition(".")[2])
    if other is not None:
        raise ConfigError(f"unknown config key '{key}' (did you mean '{other}'?)")
    # Compare the part after the dot too, so that `steps` finds `train.steps`.
    by_name = {c.rpartition(".")[2]: c for c in candidates}
    close = difflib.get_close_matches(key, candidates, n=1) or [
        by_name[m] for m in difflib.get_close_matches(key.rpartition(".")[2], by_name, n=1)
    ]
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(f"unknown config key '{key}'{hint}")


def _build_model(values: dict[str, Any]) -> ModelConfig:
    model = ModelConfig.from_hf_dict(values)
    # ModelConfig keeps unrecognised config.json fields in `extra`; in a run config they are typos,
    # but for the few that published config.json files carry and moemesh does not use.
    for key in model.extra:
        if key not in PUBLISHED_UNUSED:
            _unknown_key(f"model.{key}", [f"model.{name}" for name in ModelConfig.field_names()])
    return model


# config.json keys of published checkpoints that a run config may copy as they are: the quantization
# the checkpoint is stored in (train.init_from reads the checkpoint's own; `estimate` counts a LoRA
# run's base in it), gpt-oss's duplicate of num_experts_per_tok and its pre-YaRN context length.
PUBLISHED_UNUSED = ("quantization_config", "experts_per_token", "initial_context_length")


def _build_section(section: str, cls: type, values: dict[str, Any]):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    checked = {}
    for key, value in values.items():
        if key not in names:
            _unknown_key(f"{section}.{key}", [f"{section}.{n}" for n in names])
        checked[key] = _check_type(f"{section}.{key}", value, hints[key])
    return cls(**checked)


def _check_type(key: str, value: Any, expected: Any) -> Any:
    if expected is bool:
        ok = isinstance(value, bool)
    elif expected is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif expected is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif expected is str:
        ok = isinstance(value, str)
    elif expected == list[str]:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:  # list[float]
        ok = isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        value = [float(v) for v in value] if ok else value
    if not ok and expected is float and isinstance(value, float):
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    if not ok:
        name = expected.__name__ if isinstance(expected, type) else str(expected)  # list[str], not list
        raise ConfigError(f"{key} must be of type {name}, got {value!r}")
    return value


PARALLEL_AXES = ("dp_replicate", "dp_shard", "ep", "tp", "pp")
DATA_CHOICES = {
    "format": ("auto", "text", "messages", "sharegpt", "prompt_completion", "alpaca"),
    "train_on": ("assistant", "last_assistant", "all"),
    "too_long": ("drop", "truncate", "error"),
}


def _validate(config: RunConfig) -> None:
    train, data, model = config.train, config.data, config.model

    def need(ok: bool, message: str):
        if not ok:
            raise ConfigError(message)

    for name in ["steps", "global_batch", "micro_batch", "seq_len", "eval_sequences", "log_every", "max_bad_steps"]:
        need(getattr(train, name) >= 1, f"train.{name} must be >= 1, got {getattr(train, name)}")
    need(train.save_every >= -1, f"train.save_every must be >= -1, got {train.save_every}")
    for name in [
        "warmup_steps",
        "eval_every",
        "seed",
        "weight_decay",
        "grad_clip",
        "router_bias_update_rate",
        "keep_checkpoints",
        "threads",
    ]:
        need(getattr(train, name) >= 0, f"train.{name} must be >= 0, got {getattr(train, name)}")
    need(train.lr > 0, f"train.lr must be > 0, got {train.lr}")
    need(
        not (train.resume and train.overwrite),
        "train.resume=true continues the run in train.run_dir and train.overwrite=true deletes it: choose one",
    )
    need(0 <= train.min_lr_ratio <= 1, f"train.min_lr_ratio must be in [0, 1], got {train.min_lr_ratio}")
    need(
        len(train.betas) == 2 and all(0 <= b < 1 for b in train.betas),
        f"train.betas must be two numbers in [0, 1), got {train.betas}",
    )
    need(
        train.dtype in ("auto", "float32", "bfloat16"),
        f"train.dtype must be 'auto', 'float32' or 'bfloat16', got {train.dtype!r}",
    )
    need(
        train.param_dtype in ("float32", "bfloat16"),
        f"train.param_dtype must be 'float32' or 'bfloat16', got {train.param_dtype!r}",
    )
    need(
        train.activation_checkpointing in ("none", "full", "selective"),
        f"train.activation_checkpointing must be 'none', 'full' or 'selective', got {train.activation_checkpointing!r}",
    )
    _check_device_name(train.device, "train.device")
    _check_report_to(train.report_to)
    need(0 < data.val_fraction < 1, f"data.val_fraction must be in (0, 1), got {data.val_fraction}")
    for key, allowed in DATA_CHOICES.items():
        value = getattr(data, key)
        need(value in allowed, f"data.{key} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    need(
        train.seq_len <= model.max_position_embeddings,
        f"train.seq_len ({train.seq_len}) exceeds model.max_position_embeddings ({model.max_position_embeddings})",
    )
    for name in PARALLEL_AXES:
        need(getattr(config.parallel, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(config.parallel, name)}")
    need(config.parallel.timeout_s > 0, f"parallel.timeout_s must be > 0, got {config.parallel.timeout_s}")
    need(config.parallel.ep_capacity > 0, f"parallel.ep_capacity must be > 0, got {config.parallel.ep_capacity}")
    need(
        config.parallel.ep_dispatch in DISPATCHERS,
        f"parallel.ep_dispatch must be one of {', '.join(map(repr, DISPATCHERS))}, got {config.parallel.ep_dispatch!r}",
    )
    # The micro-batches of a step, and each rank's slice of them, must not depend on the layout.
    ranks = config.parallel.batch_ranks
    need(
        train.global_batch % train.micro_batch == 0,
        f"train.global_batch ({train.global_batch}) must be divisible by train.micro_batch ({train.micro_batch})",
    )
    need(
        train.micro_batch % ranks == 0,
        f"train.micro_batch ({train.micro_batch}) must be divisible by the data-parallel size "
        f"(parallel.dp_replicate × parallel.dp_shard × parallel.ep = {ranks})",
    )
    need(
        model.num_experts % config.parallel.ep == 0,
        f"parallel.ep ({config.parallel.ep}) must divide model.num_experts ({model.num_experts})",
    )
    config.lora.check()
    if train.cuda_graphs:
        split = [f"parallel.{name} = {getattr(config.parallel, name)}" for name in PARALLEL_AXES if name != "ep"]
        split = [axis for axis in split if not axis.endswith(" = 1")]
        need(
            not split,
            f"train.cuda_graphs captures the step of one process or of expert parallelism alone; not with "
            f"{', '.join(split)}",
        )
        need(
            config.parallel.ep == 1 or config.parallel.ep_dispatch == "gather",
            'train.cuda_graphs under expert parallelism needs parallel.ep_dispatch = "gather": "all_to_all" '
            "waits for the host once a layer",
        )
        need(
            not (config.lora.enabled and config.lora.dropout > 0),
            f"train.cuda_graphs replays the same random numbers every step: set lora.dropout = 0 "
            f"(got {config.lora.dropout}) or train.cuda_graphs = false",
        )
        need(
            not (config.lora.experts and config.lora.rank % 8),
            f"train.cuda_graphs with adapters on the experts needs lora.rank a multiple of 8 (got "
            f"{config.lora.rank}): the grouped GEMM kernel wants 16-byte rows, and its fallback waits for the host",
        )
    _check_tp_sizes(model, config.parallel.tp)
    _check_pipeline(config)


def _check_report_to(names: list[str]) -> None:
    """Known names, each once, whose packages are installed: said now, before a model is built."""
    for name in names:
        if name not in REPORT_TO:
            close = difflib.get_close_matches(name, REPORT_TO, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"train.report_to: unknown {name!r}{hint}; choose from {', '.join(REPORT_TO)}")
        if names.count(name) > 1:
            raise ConfigError(f"train.report_to names {name!r} twice")
        package = REPORT_TO[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"train.report_to includes {name!r}, but {package} is not installed: "
                f"pip install {package} (or pip install 'moemesh[tracking]')"
            )


def _check_tp_sizes(model: ModelConfig, tp: int) -> None:
    """Tensor parallelism splits heads, the vocabulary and the MLP widths into tp equal parts, and
    the key/value heads too unless tp is a multiple of them (each rank then keeps a copy of one)
    (`apply_tp` checks the same, but only after every process has started)."""
    layers = range(model.num_hidden_layers)
    sizes = ["num_attention_heads", "vocab_size"]
    if any(model.is_moe_layer(i) for i in layers):
        sizes.append("moe_intermediate_size")
    if not all(model.is_moe_layer(i) for i in layers):
        sizes.append("intermediate_size")
    for name in sizes:
        if getattr(model, name) % tp:
            raise ConfigError(f"parallel.tp ({tp}) must divide model.{name} ({getattr(model, name)})")
    for name in ("num_key_value_heads", "num_global_key_value_heads"):
        heads = getattr(model, name)
        if heads is not None and heads % tp and tp % heads:
            raise ConfigError(f"parallel.tp ({tp}) must divide model.{name} ({heads}) or be a multiple of it")


def _check_pipeline(config: RunConfig) -> None:
    parallel, train = config.parallel, config.train
    if parallel.pp == 1:
        return
    needed, micro_batches = (
        min_micro_batches(parallel.pp_schedule, parallel.pp),
        train.global_batch // train.micro_batch,
    )
    if micro_batches < needed:
        raise ConfigError(
            f"parallel.pp_schedule = {parallel.pp_schedule!r} with parallel.pp={parallel.pp} needs at "
            f"least {needed} micro-batches per step, got train.global_batch / train.micro_batch = "
            f"{train.global_batch} / {train.micro_batch} = {micro_batches}"
        )


def _check_layout_available(parallel: ParallelConfig) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    needed = parallel.world_size
    if world != needed:
        raise ConfigError(
            f"the layout parallel.dp_replicate × dp_shard × ep × tp × pp needs {needed} processes, "
            f"but {world} were launched (WORLD_SIZE={world}); use torchrun --nproc-per-node {needed}"
        )


def dumps_toml(sections: dict[str, dict[str, Any]]) -> str:
    """TOML for flat sections of numbers, strings, booleans, lists and inline tables."""
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None]
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
