"""No rank ever holds the whole model: 4 CPU processes (gloo) lay out a ~400 MB Qwen3-MoE (64
experts of 256 × 512, fp32) read from a Hugging Face directory (32 MiB safetensors shards), and
each reports how much resident memory it gained, as the kernel counts it (the peak, VmHWM;
tests/memory_probe.py). The pages of the shard being read count too (safetensors maps the file),
so a rank's peak is its part plus about one shard.

- EP=4 training: setting up (model on the meta device, laid out, a quarter of the experts
  allocated and read) costs a rank at most half the model's bytes; one training step (weights,
  gradients and AdamW's two moments of its part: about the model's bytes) at most half of what one
  process holds to train it (4× the model's bytes).
- TP=4 generation: loading costs a rank at most half the model's bytes (it keeps a quarter of every
  expert and attention matrix).
Before the meta-device build every rank built the whole model first: over 1× in setup alone.
"""

import json

import pytest
import torch

from moemesh.checkpoint.hf import write_pretrained
from moemesh.models import ModelConfig
from moemesh.models.build import meta_model
from test_parallel_train import torchrun
from tiny_run import write_corpus

CONFIG = ModelConfig(
    model_type="qwen3_moe",
    vocab_size=256,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("memory")
    write_corpus(directory)
    generator = torch.Generator().manual_seed(0)
    shapes = meta_model(CONFIG).state_dict()
    tensors = ((name, torch.randn(t.shape, generator=generator) * 0.02) for name, t in shapes.items())
    write_pretrained(tensors, CONFIG, directory / "hf", max_shard_bytes=32 * 2**20)
    model_bytes = sum(t.numel() * 4 for t in shapes.values())
    assert model_bytes > 350 * 2**20
    return directory, model_bytes


def probe(directory, mode: str) -> list[dict]:
    result = torchrun(4, "tests/memory_probe.py", mode, str(directory / "hf"), str(directory / f"run-{mode}"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((directory / f"{mode}-rank{rank}.json").read_text()) for rank in range(4)]


def test_ep4_training_rank_holds_far_less_than_the_model(model_dir):
    directory, model_bytes = model_dir
    for row in probe(directory, "train"):
        assert row["setup"] <= model_bytes / 2, (row, model_bytes)
        assert row["total"] <= 4 * model_bytes / 2, (row, model_bytes)


def test_tp4_generation_rank_loads_far_less_than_the_model(model_dir):
    directory, model_bytes = model_dir
    for row in probe(directory, "generate"):
        assert row["setup"] <= model_bytes / 2, (row, model_bytes)
