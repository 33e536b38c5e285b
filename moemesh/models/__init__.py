"""Plain PyTorch MoE models with Hugging Face-compatible configs, parameter names and checkpoints.
No distributed code lives here: parallelism is applied to a built model from `moemesh.parallel`."""

from moemesh.models import registry  # noqa: F401  (each family registers itself as it is imported)
from moemesh.models.build import build
from moemesh.models.config import ModelConfig
from moemesh.models.kv_cache import PagedKVCache
from moemesh.models.transformer import CausalLMOutput, MoECausalLM

__all__ = ["ModelConfig", "build", "PagedKVCache", "MoECausalLM", "CausalLMOutput"]
