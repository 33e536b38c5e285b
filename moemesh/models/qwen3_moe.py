"""Qwen3-MoE (Qwen3-30B-A3B style): softmax router with optional top-k renormalisation, RMSNorm on
each query/key head, dense layers mixed in by `decoder_sparse_step` / `mlp_only_layers`."""

from moemesh.models.config import ModelConfig
from moemesh.models.family import Family


def _read(hf: dict) -> None:
    # transformers ignores sliding_window unless use_sliding_window is true.
    if not hf.pop("use_sliding_window", False):
        hf["sliding_window"] = None


def _write(hf: dict, config: ModelConfig) -> None:
    hf["use_sliding_window"] = hf["sliding_window"] is not None


FAMILY = Family(
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    renames={"num_local_experts": "num_experts"},
    fixed={"qk_norm": True},
    read_hook=_read,
    write_hook=_write,
)
