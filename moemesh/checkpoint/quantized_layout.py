"""Where the quantized tensors of a published checkpoint are, under which names, and which are not
quantized: the layouts of `quantized.py`'s formats in Hugging Face directories, read and written.

Read (`dequantized`): a checkpoint's stored tensors become those of its unquantized release, lazily
dequantized, so that every family's renaming (hf.py, gpt_oss.py) runs on them unchanged:
- fp8 (transformers' FineGrainedFP8) and compressed-tensors: `X.weight` (e4m3) with its
  `X.weight_scale_inv` (compressed-tensors: `X.weight_scale`) is `X.weight`;
- mxfp4 (gpt-oss): `X_blocks` with `X_scales` ([out, in] blocks) is transformers' parameter `X`, the
  transposed [in, out] (`mlp.experts.gate_up_proj` [E, H, 2I], gate and up interleaved).
A module that `modules_to_not_convert` (compressed-tensors: `ignore`) lists is left as stored.

Written (`QuantizedWriter`), as the families' published checkpoints are:
- fp8 (`weight_block_size` [128, 128], F32 scales): every 2-D linear weight of attention and the
  MLPs (experts, shared experts, dense layers); embeddings, the head, norms, routers and their
  biases (DeepSeek's e_score_correction_bias) stay in the model's dtype. DeepSeek's config names
  no modules_to_not_convert, as DeepSeek-V3's does not; the other families' list every module left
  unquantized, as Qwen3's FP8 releases do. Families: qwen3_moe, mixtral, deepseek_v2, deepseek_v3.
- mxfp4: gpt-oss's experts only (`gate_up_proj`, `down_proj`; their biases stay), with gpt-oss's
  published modules_to_not_convert; hidden and expert sizes must be multiples of 32.
"""

from __future__ import annotations

import torch

from moemesh.checkpoint.lazy import Lazy
from moemesh.checkpoint.quantized import BlockFp8, Mxfp4, Scheme, quantize_fp8, quantize_mxfp4
from moemesh.errors import CheckpointError
from moemesh.models.config import ModelConfig

METHODS = ("fp8", "mxfp4")
FP8_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3")
# gpt-oss-20b's and -120b's config.json
GPT_OSS_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
_MXFP4_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def dequantized(stored: dict[str, Lazy], scheme: Scheme, source) -> dict[str, Lazy]:
    """The checkpoint's tensors under its unquantized release's names (module docstring)."""
    out = dict(stored)
    if scheme.method == "mxfp4":
        for key in [k for k in stored if k.endswith("_blocks")]:
            name = key.removesuffix("_blocks")
            if not scheme.converts(name.rpartition(".")[0]):
                continue
            if f"{name}_scales" not in out:
                raise CheckpointError(f"{source}: {key} has no {name}_scales beside it")
            out[name] = Mxfp4(key, out.pop(key), out.pop(f"{name}_scales")).transpose(-2, -1)
        return out
    suffix = scheme.scale_suffix
    for key in [k for k in stored if k.endswith(f".{suffix}")]:
        module = key.removesuffix(f".{suffix}")
        if not scheme.converts(module):
            continue
        if f"{module}.weight" not in out:
            raise CheckpointError(f"{source}: {key} has no {module}.weight beside it")
        out[f"{module}.weight"] = BlockFp8(
            f"{source}: {module}.weight", out[f"{module}.weight"], out.pop(key), scheme.block
        )
    for key, tensor in out.items():
        if tensor.dtype == torch.float8_e4m3fn and scheme.converts(key.rpartition(".")[0]):
            raise CheckpointError(f"{source}: {key} is stored in float8 without its {suffix}")
    return out


class QuantizedWriter:
    """The tensors a published checkpoint of `method` stores for each of a model's tensors (under
    their Hub names), and the `quantization_config` of its config.json."""

    def __init__(self, method: str, config: ModelConfig, dtype: torch.dtype | None = None):
        if method not in METHODS:
            raise CheckpointError(f"cannot quantize to {method!r}: moemesh writes {' and '.join(METHODS)}")
        families = FP8_FAMILIES if method == "fp8" else ("gpt_oss",)
        if config.model_type not in families:
            hint = " (gpt-oss publishes its experts in mxfp4)" if config.model_type == "gpt_oss" else ""
            raise CheckpointError(
                f"cannot quantize a {config.model_type} model to {method}: moemesh writes {method} in the "
                f"published layout of {', '.join(families)}{hint}"
            )
        if method == "mxfp4":
            odd = {k: getattr(config, k) for k in ("hidden_size", "moe_intermediate_size") if getattr(config, k) % 32}
            if odd:
                raise CheckpointError(f"cannot quantize to mxfp4: groups of 32 need sizes that 32 divides, got {odd}")
        self.method, self.config, self.dtype = method, config, dtype
        self.kept: dict[str, None] = {}  # modules left unquantized, in order

    def tensors(self, hub_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        module = hub_name.rpartition(".")[0]
        try:
            if self.method == "mxfp4" and hub_name.endswith(_MXFP4_EXPERTS):
                blocks, scales = quantize_mxfp4(tensor.transpose(-2, -1))  # stored [E, out, in]
                return {f"{hub_name}_blocks": blocks, f"{hub_name}_scales": scales}
            if self.method == "fp8" and _is_linear_weight(hub_name, tensor):
                weight, scale = quantize_fp8(tensor)
                return {hub_name: weight, f"{module}.weight_scale_inv": scale}
        except ValueError as error:  # not finite
            raise CheckpointError(f"cannot quantize {hub_name}: {error}") from None
        self.kept[module] = None
        return {hub_name: tensor if self.dtype is None else tensor.to(self.dtype)}

    def config_block(self) -> dict:
        if self.method == "mxfp4":
            return {"quant_method": "mxfp4", "modules_to_not_convert": GPT_OSS_NOT_CONVERTED}
        block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        if not self.config.model_type.startswith("deepseek"):
            block["modules_to_not_convert"] = list(self.kept)
        return block


def _is_linear_weight(hub_name: str, tensor: torch.Tensor) -> bool:
    """A projection's weight: 2-D, not the embedding, the head or a router (`mlp.gate`, Mixtral's
    `block_sparse_moe.gate`)."""
    module = hub_name.rpartition(".")[0]
    leaf = module.rpartition(".")[2]
    return (
        hub_name.endswith(".weight") and tensor.ndim == 2 and leaf not in ("embed_tokens", "lm_head", "gate", "router")
    )
