"""Expert parallelism on 4 CPU processes (gloo), fp32, against one process.

Every check builds the full model from the same seed on every rank, takes the single-process
reference (computed on rank 0, received whole by the others), then shards (EP over 4 ranks, or
2 EP ranks × 2 data-parallel replicas) and compares loss, logits and every gradient. Tolerance
1e-5 relative: the sharded run adds the same fp32 terms in another order (partial sums per rank),
which moves results by ~1e-7."""

import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from moemesh.models import ModelConfig, build
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel, label_tokens, rank_loss, reduce_gradients
from moemesh.parallel.expert import HEADROOM, apply_ep, fit_capacity, is_expert_parameter, start_capacity
from moemesh.parallel.mesh import ParallelDims, init_mesh
from numerics import rel_err

WORLD = 4
RTOL = 1e-5
CONFIG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    intermediate_size=24,
    mlp_only_layers=[1],
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)


def micro_batch(seed=0, batch=8, seq=9):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, CONFIG.vocab_size, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[1, 2:5] = -100
    return input_ids, labels


def reference_step(reference, input_ids, labels):
    """One process's forward and backward of `reference` on rank 0, its output and gradients sent
    to the other ranks exactly (pickled): the same on every rank (the same seed and inputs), so the
    others wait instead of computing it again, 4 ranks on 2 cores (with the kernels interpreted,
    half of a check's time). -> the output; every rank's `reference` holds the gradients."""
    sent = [None]
    if dist.get_rank() == 0:
        out = reference(input_ids, labels=labels)
        out.loss.backward()
        grads = {name: p.grad for name, p in reference.named_parameters()}
        sent = [(out.loss.detach(), out.logits.detach(), out.aux_loss.detach(), grads)]
    dist.broadcast_object_list(sent, src=0)
    loss, logits, aux_loss, grads = sent[0]
    for name, param in reference.named_parameters():
        param.grad = grads[name]
    return SimpleNamespace(loss=loss, logits=logits, aux_loss=aux_loss)


def sharded_step(
    dims: ParallelDims, config: ModelConfig, input_ids, labels, prepare=lambda model: None, dispatch="gather"
):
    """Reference (one process) and sharded forward+backward of one micro-batch on this rank.
    Returns (reference model, reference output, sharded model, this rank's summed loss)."""
    reference = build(config, seed=1)
    prepare(reference)
    ref_out = reference_step(reference, input_ids, labels)

    mesh = init_mesh(dims)
    model = build(config, seed=1)
    prepare(model)
    apply_data_parallel(apply_ep(model, mesh, dispatch), mesh)
    ranks, rank = dims.batch_size, mesh.rank("batch")
    rows = input_ids.shape[0] // ranks
    local = slice(rank * rows, (rank + 1) * rows)
    comm.reset_counts()
    out = model(input_ids[local], labels=labels[local])
    forward_bytes = dict(comm.sent_bytes)
    loss = rank_loss(
        out.ce_loss, out.aux_loss, label_tokens(labels[local]), label_tokens(labels), config.router_aux_loss_coef, ranks
    )
    loss.backward()
    reduce_gradients(model, mesh)
    summed = loss.detach().clone()
    comm.all_reduce_sum_([summed], mesh.group("batch"))
    return reference, ref_out, model, summed, out, local, mesh, forward_bytes


def check_matches_single_process(rank, dp, ep, kernels="auto", dispatch="gather"):
    os.environ["MOEMESH_KERNELS"] = kernels  # read at every call; TRITON_INTERPRET came from conftest
    try:
        return _check_matches_single_process(dp, ep, dispatch)
    finally:
        os.environ.pop("MOEMESH_KERNELS")


def _check_matches_single_process(dp, ep, dispatch):
    input_ids, labels = micro_batch(seed=dp * 10 + ep)
    reference, ref_out, model, loss, out, local, mesh, _ = sharded_step(
        ParallelDims(dp_replicate=dp, ep=ep), CONFIG, input_ids, labels, dispatch=dispatch
    )
    assert rel_err(loss, ref_out.loss.detach()) <= RTOL
    assert rel_err(out.logits, ref_out.logits[local].detach()) <= RTOL
    assert rel_err(out.aux_loss, ref_out.aux_loss) <= RTOL  # the same value on every rank
    ep_rank, local_experts = mesh.rank("ep"), CONFIG.num_experts // ep
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        if is_expert_parameter(name):
            expected = expected[ep_rank * local_experts : (ep_rank + 1) * local_experts]
            assert param.shape[0] == local_experts
        assert param.grad is not None and expected.norm() > 0, name
        assert rel_err(param.grad, expected) <= RTOL, name
    return True


@pytest.mark.parametrize(
    "dp, ep, kernels, dispatch",
    [(1, 4, "auto", "gather"), (2, 2, "auto", "gather"), (1, 4, "triton", "gather"), (1, 4, "triton", "all_to_all")],
)
def test_ep_equals_one_process(pool, dp, ep, kernels, dispatch):
    """kernels="triton": the permute/combine kernels (interpreted on CPU) on both sides."""
    assert all(pool.run(check_matches_single_process, dp, ep, kernels, dispatch))


def _zero_router(model):
    """A zero router gives every token the same probabilities, so every token chooses the same k
    experts: one or two EP ranks receive everything, the others nothing, most experts no token."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.zero_()


def check_degenerate_routing(rank, top_k, dispatch):
    config = CONFIG.replace(num_experts_per_tok=top_k)
    local_experts = config.num_experts // WORLD
    input_ids, labels = micro_batch(seed=5)
    reference, ref_out, model, loss, out, local, mesh, forward_bytes = sharded_step(
        ParallelDims(ep=WORLD), config, input_ids, labels, _zero_router, dispatch
    )
    chosen = set(model.model.layers[0].mlp.route(torch.randn(6, config.hidden_size)).expert_ids.flatten().tolist())
    assert len(chosen) == top_k
    holders = {e // local_experts for e in chosen}
    assert rel_err(loss, ref_out.loss.detach()) <= RTOL
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        if is_expert_parameter(name):
            expected = expected[rank * local_experts : (rank + 1) * local_experts]
            assert (param.grad.norm() > 0) == (rank in holders), name
        assert (rel_err(param.grad, expected) <= RTOL) if expected.norm() > 0 else param.grad.norm() == 0, name
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    tokens, hidden, k = input_ids[local].numel(), config.hidden_size, config.num_experts_per_tok
    if dispatch == "gather":
        # Every token goes to every rank (its row, k weights and k int32 ids); every rank sends the
        # sums of every rank's tokens back (fp32 rows), holder or not.
        assert forward_bytes[("all_gather", "forward")] == moe_layers * tokens * (hidden * 4 + k * 4 + k * 4)
        assert forward_bytes[("all_to_all", "forward")] == moe_layers * WORLD * tokens * hidden * 4
        return True
    # Each token travels once to each holder (its row, k weights and k local ids); only holders
    # send rows back, one per token of every rank.
    dispatched = len(holders) * tokens * (hidden * 4 + k * 4 + k * 8)
    combined = WORLD * tokens * hidden * 4 if rank in holders else 0
    assert forward_bytes[("all_to_all", "forward")] == moe_layers * (dispatched + combined)
    return True


@pytest.mark.parametrize("top_k, dispatch", [(1, "gather"), (2, "gather"), (2, "all_to_all")])
def test_degenerate_routing_all_tokens_to_the_same_experts(pool, top_k, dispatch):
    assert all(pool.run(check_degenerate_routing, top_k, dispatch))


def check_capacity(rank):
    """Every token to the same 2 experts: their holders need 2× (4× if one rank holds both) the
    mean rows. With a buffer of 1.25× the forward drops pairs and `fit_capacity` says so, the same
    on every rank, and raises the buffer; with it the forward is exact, and the next call finds
    nothing to say."""
    config = CONFIG.replace(num_experts_per_tok=2)
    mesh = init_mesh(ParallelDims(ep=WORLD))
    reference = build(config, seed=1)
    _zero_router(reference)
    model = apply_ep(build(config, seed=1), mesh)
    _zero_router(model)
    input_ids, _ = micro_batch(seed=6, batch=WORLD)
    expected = reference(input_ids).logits

    def logits():  # of every rank's tokens
        return comm.all_gather(model(input_ids[rank : rank + 1]).logits, mesh.group("ep"), dim=0)

    start_capacity(model, 1.25)
    dropped = logits()
    overflowed = fit_capacity(model, dist.group.WORLD)
    said = comm.all_gather_object(overflowed)
    assert rel_err(dropped, expected) > 1e-3  # pairs were dropped: wrong, and said
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    chosen = model.model.layers[0].mlp.route(torch.randn(1, config.hidden_size)).expert_ids.flatten().tolist()
    slots = max(Counter(e // (config.num_experts // WORLD) for e in chosen).values())  # the busiest holder's
    need = WORLD * slots / len(chosen)  # it serves every rank's tokens: ranks × slots rows a token, mean k
    assert overflowed == [
        f"layer {i} needed {need:.2f}× the mean expert rows, past its room; now {HEADROOM * need:.2f}×"
        for i in moe_layers
    ]
    assert all(lines == overflowed for lines in said)  # every rank: the same lines, whatever it holds
    assert rel_err(logits(), expected) <= RTOL
    assert fit_capacity(model, dist.group.WORLD) == []
    return True


def test_a_full_expert_buffer_is_reported_and_raised(pool):
    assert all(pool.run(check_capacity))


def check_collective_counts(rank, dispatch):
    """Per MoE layer: one dispatch and one combine collective forward, the same backward (an
    all-gather and an all-to-all each way; with exact splits two all-to-alls, the split sizes
    once forward); the aux statistics once per forward and backward."""
    mesh = init_mesh(ParallelDims(ep=WORLD))
    model = apply_data_parallel(apply_ep(build(CONFIG, seed=1), mesh, dispatch), mesh)
    input_ids, labels = micro_batch(seed=7, batch=WORLD)
    moe_layers = sum(CONFIG.is_moe_layer(i) for i in range(CONFIG.num_hidden_layers))
    comm.reset_counts()
    out = model(input_ids[rank : rank + 1], labels=labels[rank : rank + 1])
    forward = dict(comm.calls)
    out.loss.backward()
    backward = {key: n - forward.get(key, 0) for key, n in comm.calls.items()}
    dispatch_kinds = ["all_gather", "all_to_all"] if dispatch == "gather" else ["all_to_all", "all_to_all"]
    expected_forward = Counter({("all_reduce", "forward"): 1})
    expected_backward = Counter({("all_reduce", "backward"): 1})
    for kind in dispatch_kinds:
        expected_forward[(kind, "forward")] += moe_layers
        expected_backward[(kind, "backward")] += moe_layers
    if dispatch == "all_to_all":
        expected_forward[("exchange_sizes", "forward")] = moe_layers
    assert forward == dict(expected_forward), forward
    assert {k: v for k, v in backward.items() if v} == dict(expected_backward), backward
    return True


@pytest.mark.parametrize("dispatch", ["gather", "all_to_all"])
def test_collective_counts_per_moe_layer(pool, dispatch):
    assert all(pool.run(check_collective_counts, dispatch))


def mesh_device_with_a_gpu_in_sight(rank) -> str:
    """init_mesh in a gloo group, on a machine that seems to have a GPU (fewer than the ranks)."""
    from unittest import mock

    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda, "device_count", return_value=1),
    ):
        mesh = init_mesh(ParallelDims(ep=WORLD))
    return mesh.device_mesh.device_type


def test_a_cpu_group_builds_a_cpu_mesh_on_a_machine_with_a_gpu(pool):
    """The ranks of a gloo group (the tests' pool, or `train.device = cpu` under torchrun) build a
    CPU mesh even where a GPU is present: each asking for a GPU of its own failed on a one-GPU
    machine ("invalid device ordinal")."""
    assert pool.run(mesh_device_with_a_gpu_in_sight) == ["cpu"] * WORLD
