"""Activation checkpointing (`train.activation_checkpointing`, `ops/recompute.py`) in one process,
fp32 on CPU: "full" and "selective" give the loss and every gradient of "none" bit for bit (the
recomputation runs the same ops on the same inputs), and the forward leaves less memory held for
backward: full < selective < none. The same equalities under parallel layouts are checked in
test_parallel_tensor.py (EP × TP) and test_parallel_pipeline.py (DualPipeV under EP and FSDP)."""

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moemesh.config import load_config
from moemesh.errors import ConfigError
from moemesh.models import ModelConfig, build
from moemesh.ops import recompute

QWEN3 = ModelConfig(
    vocab_size=64,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=24,
    intermediate_size=40,
    mlp_only_layers=[1],
    attention_bias=True,
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)
# DeepSeek-V3: latent attention, group-limited sigmoid router whose expert loads a training forward
# counts (a recomputation must not count them again), a shared expert, a dense first layer.
DEEPSEEK_V3 = ModelConfig.from_hf_dict(
    dict(
        model_type="deepseek_v3",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=40,
        moe_intermediate_size=12,
        initializer_range=0.1,
        kv_lora_rank=16,
        q_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        output_router_logits=True,
    )
)
GPT_OSS = ModelConfig.from_hf_dict(
    dict(
        model_type="gpt_oss",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        initializer_range=0.1,
        output_router_logits=True,
    )
)


class HeldMemory(TorchDispatchMode):
    """The bytes of the storages the ops inside it made that are still alive (after a forward:
    what it keeps for backward, and its outputs)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                self.storages.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return out

    def alive(self) -> int:
        gc.collect()
        return sum(nbytes for ref, nbytes in self.storages.values() if not ref.expired())


def step(config: ModelConfig, mode: str, input_ids: torch.Tensor):
    """(loss, gradients, bytes the forward left held, DeepSeek-V3's expert loads) of one forward
    and backward with activation checkpointing `mode`."""
    model = build(config, seed=3)
    model.activation_checkpointing = mode
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero biases, so that a bias gradient means something
        for name, tensor in model.named_parameters():
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.2, generator=generator)
    held = HeldMemory()
    with held:
        out = model(input_ids, labels=input_ids, return_logits=False)
    held_bytes = held.alive()
    out.loss.backward()
    loads = [m.expert_load.clone() for m in model.modules() if getattr(m, "expert_load", None) is not None]
    return out.loss.detach(), {name: p.grad for name, p in model.named_parameters()}, held_bytes, loads


@pytest.mark.parametrize("config", [QWEN3, DEEPSEEK_V3, GPT_OSS], ids=["qwen3", "deepseek_v3", "gpt_oss"])
def test_recomputation_changes_no_gradient_and_holds_less(config):
    input_ids = torch.randint(0, config.vocab_size, (3, 40))
    plain_loss, plain_grads, plain_bytes, plain_loads = step(config, "none", input_ids)
    held = {}
    for mode in ("full", "selective"):
        loss, grads, held[mode], loads = step(config, mode, input_ids)
        assert torch.equal(loss, plain_loss), mode
        assert grads.keys() == plain_grads.keys()
        for name, grad in grads.items():
            assert grad is not None and torch.equal(grad, plain_grads[name]), (mode, name)
        assert len(loads) == len(plain_loads) and all(torch.equal(a, b) for a, b in zip(loads, plain_loads)), mode
    assert held["full"] < held["selective"] < plain_bytes, (held, plain_bytes)
    if config is QWEN3:  # at least half the activations go; full keeps one input per layer
        assert held["selective"] < 0.7 * plain_bytes and held["full"] < 0.3 * plain_bytes, (held, plain_bytes)
    if config is DEEPSEEK_V3:
        assert plain_loads and all(load.sum() > 0 for load in plain_loads)


def test_selective_recomputes_no_matmul():
    """In selective mode, the recomputation in backward runs no matmul but each router's small
    logits product, while full runs them all again; evaluation (no gradients) checkpoints nothing."""
    input_ids = torch.randint(0, QWEN3.vocab_size, (2, 16))
    matmuls = {}
    for mode in ("none", "full", "selective"):
        model = build(QWEN3, seed=3)
        model.activation_checkpointing = mode
        out = model(input_ids, labels=input_ids, return_logits=False)
        with CountOps() as counted:
            out.loss.backward()
        matmuls[mode] = counted.matmuls
    routers = sum(QWEN3.is_moe_layer(i) for i in range(QWEN3.num_hidden_layers))
    assert matmuls["selective"] == matmuls["none"] + routers < matmuls["full"]
    model = build(QWEN3, seed=3)
    model.activation_checkpointing = "full"
    with torch.no_grad():
        out = model(input_ids, labels=input_ids)
    assert out.loss.grad_fn is None


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.matmuls += 1
        return func(*args, **(kwargs or {}))


def test_kept_result_modified_in_place_is_refused():
    weight = torch.randn(4, 4, requires_grad=True)

    def region(x):
        y = recompute.kept(lambda: x @ weight)
        y.mul_(2)  # a kept result must reach the recomputation as the forward left it
        return y.sin()

    out = recompute.checkpointed(region, "selective", torch.randn(3, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match="modified in place"):
        out.sum().backward()


def test_unknown_mode_is_a_config_error():
    with pytest.raises(ConfigError, match="train.activation_checkpointing must be 'none', 'full' or 'selective'"):
        load_config(None, ["train.activation_checkpointing=partial"])
