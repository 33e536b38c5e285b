"""LoRA (`models/lora.py`) in one process, fp32 on CPU, against a float64 reference built from the
merged weights W + s·B·A (the definition of what an adapter computes): the loss, the logits and
every adapter's gradient, differentiated through the merge. Attention, a dense MLP layer, DeepSeek's
shared experts and latent attention, and every expert of every MoE layer carry adapters; B is made
non-zero so that both factors matter. The expert banks' grouped-GEMM path is also checked alone
with empty experts, a single token, no tokens and a strong imbalance.

Tolerance 1e-5 relative: the fp32 model against the fp64 one differs by fp32 rounding (~1e-7 per
operation) over a few hundred operations; a wrong scaling, a transposed factor or an adapter on the
wrong expert is orders larger."""

from collections import Counter

import pytest
import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from moemesh.errors import ConfigError
from moemesh.models import ModelConfig, build
from moemesh.models.adapted import projections as adapted_projections
from moemesh.models.build import init_weights, meta_model
from moemesh.models.lora import LoraConfig, add_linear_adapter, apply_lora, has_adapter, is_adapter, merge_adapters
from moemesh.models.moe import EXPERT_BANKS, Experts
from moemesh.ops.grouped_mm import grouped_mm
from moemesh.ops.linear import linear
from moemesh.ops.low_rank import low_rank_factors
from moemesh.train.optim import build_optimizer
from numerics import rel_err
from test_activation_checkpointing import DEEPSEEK_V3, QWEN3

RTOL = 1e-5
QWEN3_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "layers.1.mlp.*_proj"]  # attention, the dense layer
DEEPSEEK_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "shared_experts.*", "mlp.gate"]


def lora_model(config: ModelConfig, lora: LoraConfig, seed: int = 3) -> torch.nn.Module:
    """Built on the meta device, adapted, then initialised (as the trainer does); B made non-zero."""
    model = meta_model(config)
    apply_lora(model, lora)
    model.to_empty(device="cpu")
    model.tie_weights()
    init_weights(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("lora_B") or name.endswith("bias"):
                param.normal_(0.0, 0.3, generator=generator)
    return model


def merged_weights(model: torch.nn.Module, factors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every adapted weight as W + s·B·A in float64, differentiable in the factors `factors`."""
    merged = {}
    for name, module in model.named_modules():
        if has_adapter(module):
            a, b = factors[f"{name}.lora_A"], factors[f"{name}.lora_B"]
            merged[f"{name}.weight"] = module.weight.double() + b @ a * module.lora_scaling
        if isinstance(module, Experts):
            for bank, scaling in module.lora_scaling.items():
                a, b = factors[f"{name}.{bank}_lora_A"], factors[f"{name}.{bank}_lora_B"]
                merged[f"{name}.{bank}"] = getattr(module, bank).double() + torch.bmm(b, a) * scaling
    return merged


def reference(model, config, input_ids):
    """(loss, logits, gradients of every factor and trained router parameter) in float64."""
    base = build(config, dtype=torch.float64)
    base.load_state_dict({k: v.double() for k, v in model.state_dict().items() if not is_adapter(k)})
    trained = {name: p.detach().double().requires_grad_() for name, p in model.named_parameters() if p.requires_grad}
    params = {**merged_weights(model, trained), **{k: v for k, v in trained.items() if not is_adapter(k)}}
    out = functional_call(base, params, (input_ids,), {"labels": input_ids})
    out.loss.backward()
    return out.loss, out.logits, {name: t.grad for name, t in trained.items()}


@pytest.mark.parametrize(
    "config, targets", [(QWEN3, QWEN3_TARGETS), (DEEPSEEK_V3, DEEPSEEK_TARGETS)], ids=["qwen3", "deepseek_v3"]
)
def test_adapters_equal_the_merged_weights_in_float64(config, targets):
    model = lora_model(config, LoraConfig(rank=4, alpha=12.0, targets=targets))
    input_ids = torch.randint(0, config.vocab_size, (2, 17))
    out = model(input_ids, labels=input_ids)
    out.loss.backward()
    ref_loss, ref_logits, ref_grads = reference(model, config, input_ids)

    assert rel_err(out.loss, ref_loss) <= RTOL
    assert rel_err(out.logits, ref_logits) <= RTOL
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained.keys() == ref_grads.keys()
    adapters = [name for name in trained if is_adapter(name)]
    banks = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)) * len(EXPERT_BANKS)
    assert len(adapters) == 2 * (len([m for m in model.modules() if has_adapter(m)]) + banks)
    for name, param in trained.items():
        assert param.grad is not None and ref_grads[name].norm() > 0, name
        assert rel_err(param.grad, ref_grads[name]) <= RTOL, name
    # The base is frozen: no gradient, and no optimizer state (only what trains is in the optimizer).
    for name, param in model.named_parameters():
        assert (param.grad is None) == (not param.requires_grad), name
    optimized = {id(p) for group in build_optimizer(model, _train()).param_groups for p in group["params"]}
    assert optimized == {id(p) for p in trained.values()}
    if config is DEEPSEEK_V3:  # "mlp.gate" names the routers: trained in full, not adapted
        assert all(p.requires_grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight"))
    else:
        assert not any(p.requires_grad for n, p in model.named_parameters() if ".mlp.gate." in n)


def _train():
    from moemesh.config import TrainConfig

    return TrainConfig()


@pytest.mark.parametrize(
    "sizes",
    [[0, 5, 0, 1], [1, 0, 0, 0], [30, 1, 0, 2], [0, 0, 0, 0]],
    ids=["empty-experts", "one-token", "imbalance", "no-tokens"],
)
def test_expert_adapters_in_the_grouped_gemms(sizes):
    """The bank with adapters on its grouped rows against each expert's own merged weights in
    float64, output and factor gradients; an expert that got no row gets a zero gradient."""
    config = QWEN3.replace(num_experts=len(sizes), moe_intermediate_size=12, hidden_size=32)
    model = lora_model(
        config.replace(num_hidden_layers=1, mlp_only_layers=[]), LoraConfig(rank=3, alpha=5.0, targets=[])
    )
    experts = model.model.layers[0].mlp.experts
    group_sizes = torch.tensor(sizes)
    x = torch.randn(sum(sizes), config.hidden_size, requires_grad=True)
    out = experts(x, group_sizes)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    factors = {
        f"{bank}_lora_{f}": getattr(experts, f"{bank}_lora_{f}").detach().double().requires_grad_()
        for bank in EXPERT_BANKS
        for f in "AB"
    }
    weights = {
        bank: getattr(experts, bank).double()
        + torch.bmm(factors[f"{bank}_lora_B"], factors[f"{bank}_lora_A"]) * experts.lora_scaling[bank]
        for bank in EXPERT_BANKS
    }
    x64 = x.detach().double().requires_grad_()
    rows = []
    for e, piece in enumerate(x64.split(sizes)):
        gate, up = (piece @ weights["gate_up_proj"][e].T).chunk(2, dim=-1)
        rows.append((torch.nn.functional.silu(gate) * up) @ weights["down_proj"][e].T)
    expected = torch.cat(rows)
    expected.backward(grad_out.double())
    assert out.shape == expected.shape
    if sum(sizes):
        assert rel_err(out, expected) <= RTOL
        assert rel_err(x.grad, x64.grad) <= RTOL
    for name, factor in factors.items():
        grad = getattr(experts, name).grad
        assert grad is not None and grad.shape == factor.shape, name
        for e, size in enumerate(sizes):
            if size == 0:
                assert torch.equal(grad[e], torch.zeros_like(grad[e])), (name, e)
            else:
                assert rel_err(grad[e], factor.grad[e]) <= RTOL, (name, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM kernel needs a CUDA GPU")
@pytest.mark.parametrize("rank", [4, 8])
def test_expert_adapters_on_the_gpu_whether_the_kernel_takes_the_rank_or_not(rank):
    """A bf16 bank with fp32 adapters under autocast, as training runs it on a GPU: the grouped GEMM
    kernel wants rows of 16 bytes, so rank 8 takes it and rank 4 the loop; both against the
    float64 merged weights. Tolerance 2e-2: bf16 keeps 8 bits, rounded at each GEMM's input."""
    sizes = [5, 0, 17, 10]
    config = QWEN3.replace(
        num_experts=len(sizes), moe_intermediate_size=16, hidden_size=32, num_hidden_layers=1, mlp_only_layers=[]
    )
    model = lora_model(config, LoraConfig(rank=rank, alpha=5.0, targets=[])).cuda()
    experts = model.model.layers[0].mlp.experts
    for bank in EXPERT_BANKS:
        getattr(experts, bank).data = getattr(experts, bank).data.bfloat16()
    group_sizes = torch.tensor(sizes, device="cuda")
    x = torch.randn(sum(sizes), config.hidden_size, device="cuda").bfloat16().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = experts(x, group_sizes)
    out.float().sum().backward()
    weights = {
        bank: getattr(experts, bank).double()
        + torch.bmm(getattr(experts, f"{bank}_lora_B").double(), getattr(experts, f"{bank}_lora_A").double())
        * experts.lora_scaling[bank]
        for bank in EXPERT_BANKS
    }
    rows = []
    for e, piece in enumerate(x.detach().double().split(sizes)):
        gate, up = (piece @ weights["gate_up_proj"][e].T).chunk(2, dim=-1)
        rows.append((torch.nn.functional.silu(gate) * up) @ weights["down_proj"][e].T)
    assert rel_err(out, torch.cat(rows)) <= 2e-2
    assert all(getattr(experts, f"{bank}_lora_{f}").grad is not None for bank in EXPERT_BANKS for f in "AB")


@pytest.mark.parametrize("dropout", [False, True], ids=["same-input", "dropout-input"])
@pytest.mark.parametrize("op", ["linear", "grouped_mm"])
def test_base_and_update_in_one_node_against_float64(op, dropout):
    """`ops/linear.py` and `ops/grouped_mm.py` with LoRA's factors (cast by `low_rank_factors`, B
    scaled): the output x·Wᵀ + s·x_r·Aᵀ·Bᵀ and the gradients of x, of the update's own input x_r
    (LoRA's dropout) and of the fp32 factors, against float64 autograd of that formula."""
    scale = 2.5
    if op == "linear":
        x = torch.randn(2, 7, 12, requires_grad=True)  # [B, T, in]
        weight, a, b = torch.randn(10, 12), torch.randn(3, 12), torch.randn(10, 3)
        sizes = None
    else:
        sizes = torch.tensor([4, 0, 9, 1])  # an empty expert too
        x = torch.randn(14, 12, requires_grad=True)
        weight, a, b = torch.randn(4, 10, 12), torch.randn(4, 3, 12), torch.randn(4, 10, 3)
    a, b = a.requires_grad_(), b.requires_grad_()
    x_r = torch.randn(x.shape, requires_grad=True) if dropout else None
    factors = low_rank_factors(a, b, x.dtype, scale)
    if op == "linear":
        out = linear(x, weight, None, factors, x_r)
    else:
        out = grouped_mm(x, weight, sizes, low_rank=factors, x_low_rank=x_r)
    grad_out = torch.randn(out.shape)
    out.backward(grad_out)

    inputs = [t.detach().double().requires_grad_() for t in (x, a, b, x if x_r is None else x_r)]
    x64, a64, b64, xr64 = inputs
    if x_r is None:
        xr64 = x64
    if op == "linear":
        expected = x64 @ weight.double().T + scale * (xr64 @ a64.T) @ b64.T
    else:
        pieces = zip(x64.split(sizes.tolist()), xr64.split(sizes.tolist()), weight.double(), a64, b64)
        expected = torch.cat([p @ w.T + scale * (r @ ae.T) @ be.T for p, r, w, ae, be in pieces])
    expected.backward(grad_out.double())
    assert rel_err(out, expected) <= RTOL
    assert rel_err(x.grad, x64.grad) <= RTOL
    assert rel_err(a.grad, a64.grad) <= RTOL and rel_err(b.grad, b64.grad) <= RTOL
    if dropout:
        assert rel_err(x_r.grad, inputs[3].grad) <= RTOL


def test_projections_of_one_input_against_float64():
    """q, k and v adapted (ranks and scales apart, biases): one node with their A stacked gives
    each output and the gradients of x and of every factor of the separate float64 formulas."""
    projections = [torch.nn.Linear(12, out) for out in (10, 6, 6)]
    for p, (rank, alpha) in zip(projections, [(3, 6.0), (2, 2.0), (4, 2.0)]):
        p.weight.requires_grad_(False)
        add_linear_adapter(p, rank, alpha, 0.0, None)  # B at zero until filled below
        with torch.no_grad():
            p.lora_A.normal_(), p.lora_B.normal_(), p.bias.normal_()
    x = torch.randn(2, 7, 12, requires_grad=True)
    outs = adapted_projections(x, *projections)
    grads_out = [torch.randn(out.shape) for out in outs]
    torch.autograd.backward(outs, grads_out)

    x64 = x.detach().double().requires_grad_()
    for out, grad_out, p in zip(outs, grads_out, projections):
        a, b = (t.detach().double().requires_grad_() for t in (p.lora_A, p.lora_B))
        expected = x64 @ p.weight.double().T + p.bias.double() + p.lora_scaling * (x64 @ a.T) @ b.T
        expected.backward(grad_out.double())
        assert rel_err(out, expected) <= RTOL
        assert rel_err(p.lora_A.grad, a.grad) <= RTOL and rel_err(p.lora_B.grad, b.grad) <= RTOL
    assert rel_err(x.grad, x64.grad) <= RTOL


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_recomputation_with_adapters_changes_nothing(dropout, autocast):
    """Activation checkpointing on a LoRA model (attention, a dense layer and every expert
    adapted): full and selective give the loss and every adapter gradient of none bit for bit,
    dropout's masks included. Under bf16 autocast each fp32 factor is read once a forward (its
    cast) and never in backward: the recomputation and the backward use the forward's copy."""
    input_ids = torch.randint(0, QWEN3.vocab_size, (2, 13))
    results = {}
    for mode in ("none", "full", "selective"):
        torch.manual_seed(7)  # dropout's masks
        model = lora_model(QWEN3, LoraConfig(rank=4, alpha=12.0, targets=QWEN3_TARGETS, dropout=dropout))
        model.train()
        model.activation_checkpointing = mode
        factors = [p for name, p in model.named_parameters() if is_adapter(name)]
        reads = FactorReads(factors)
        with reads:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids, labels=input_ids, return_logits=False).loss
            reads.phase = "backward"
            loss.backward()
        if autocast:  # in fp32 the cast is the factor itself, used as it is
            assert reads.counts == {"forward": [1] * len(factors), "backward": [0] * len(factors)}, mode
        results[mode] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    plain_loss, plain_grads = results["none"]
    for mode in ("full", "selective"):
        loss, grads = results[mode]
        assert torch.equal(loss, plain_loss), mode
        assert grads.keys() == plain_grads.keys()
        assert all(torch.equal(grads[n], plain_grads[n]) for n in grads), mode


class FactorReads(TorchDispatchMode):
    """How many ops read each of `tensors` (views and allocations like it read nothing), in
    forward and in backward."""

    def __init__(self, tensors):
        super().__init__()
        self.storages = [t.untyped_storage().data_ptr() for t in tensors]
        self.phase, self.reads = "forward", {"forward": Counter(), "backward": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket in (torch.ops.aten.empty_like, torch.ops.aten.new_empty)):
            read = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.reads[self.phase].update(read.intersection(self.storages))
        return func(*args, **(kwargs or {}))

    @property
    def counts(self) -> dict[str, list[int]]:
        return {phase: [reads[s] for s in self.storages] for phase, reads in self.reads.items()}


def test_merge_gives_the_adapted_logits():
    model = lora_model(QWEN3, LoraConfig(rank=4, alpha=8.0, targets=QWEN3_TARGETS))
    input_ids = torch.randint(0, QWEN3.vocab_size, (2, 11))
    with torch.no_grad():
        adapted = model(input_ids).logits
        merge_adapters(model)
        merged = model(input_ids).logits
    assert not any(is_adapter(name) for name, _ in model.named_parameters())
    assert not any(has_adapter(m) for m in model.modules())
    assert rel_err(merged, adapted) <= RTOL


def test_fresh_adapters_start_as_the_base():
    """B starts at zero: the adapted model computes the base's logits exactly; A's initial std
    is PEFT's (1/sqrt(3·in))."""
    model = lora_model(QWEN3, LoraConfig(rank=8, alpha=16.0), seed=5)
    init_weights(model, 5)  # undo the test's non-zero B
    input_ids = torch.randint(0, QWEN3.vocab_size, (2, 11))
    base = build(QWEN3, seed=5)
    assert torch.equal(model(input_ids).logits, base(input_ids).logits)
    a = model.model.layers[0].self_attn.q_proj.lora_A
    assert abs(a.std().item() * (3 * QWEN3.hidden_size) ** 0.5 - 1) < 0.15


@pytest.mark.parametrize(
    "lora, message",
    [
        (LoraConfig(rank=4, targets=["q_proj", "qkv_proj"]), "lora.targets: 'qkv_proj' matches no projection"),
        (LoraConfig(rank=-1), "lora.rank must be >= 0"),
        (LoraConfig(rank=4, dropout=1.0), r"lora.dropout must be in \[0, 1\)"),
        (LoraConfig(rank=4, targets=[], experts=False), "nothing to adapt"),
    ],
)
def test_bad_lora_settings_are_config_errors(lora, message):
    with pytest.raises(ConfigError, match=message):
        apply_lora(meta_model(QWEN3), lora)


def test_lora_section_of_the_run_config():
    from moemesh.config import load_config

    config = load_config(
        None, ["lora.rank=16", "lora.alpha=32", 'lora.targets=["q_proj", "v_proj"]', "lora.experts=false"]
    )
    assert (config.lora.rank, config.lora.alpha, config.lora.targets, config.lora.experts) == (
        16,
        32.0,
        ["q_proj", "v_proj"],
        False,
    )
    with pytest.raises(ConfigError, match="lora.targets must be of type list"):
        load_config(None, ["lora.rank=16", "lora.targets=q_proj"])
    with pytest.raises(ConfigError, match="unknown config key 'lora.ranks'"):
        load_config(None, ["lora.ranks=16"])


def test_frozen_base_takes_no_weight_gradient_flops():
    """MFU counts 4 FLOPs per frozen parameter and token (forward, input gradient), 6 per trained one."""
    from moemesh.train.flops import flops_per_token

    base = build(QWEN3)
    adapted = lora_model(QWEN3, LoraConfig(rank=4, targets=["q_proj"], experts=False))
    adapter_params = sum(p.numel() for n, p in adapted.named_parameters() if is_adapter(n))
    frozen = base.num_params(active=True) - base.model.embed_tokens.weight.numel()
    assert flops_per_token(adapted, 32) == pytest.approx(flops_per_token(base, 32) - 2 * frozen + 6 * adapter_params)
