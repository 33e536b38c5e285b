"""Tensor parallelism on 4 CPU processes (gloo), fp32, against one process.

As for expert parallelism: every check builds the full model from the same seed on every rank,
computes the single-process reference itself, shards it (TP over 4 ranks, or 2 data-parallel
replicas × TP 2) and compares loss, logits (this rank's vocabulary slice) and every gradient
(sliced to this rank's shard) at 1e-5 relative."""

import pytest
import torch

from moemesh.errors import ConfigError
from moemesh.models import ModelConfig, build
from moemesh.models.registry import family
from moemesh.parallel import comm
from moemesh.parallel.data import apply_data_parallel, label_tokens, rank_loss, reduce_gradients
from moemesh.parallel.expert import apply_ep, is_expert_parameter
from moemesh.parallel.mesh import Mesh, ParallelDims, init_mesh
from moemesh.parallel.tensor import apply_tp
from numerics import rel_err

WORLD = 4
RTOL = 1e-5
# Qwen3: q/k norms, a dense layer (1) among MoE layers, attention biases.
QWEN3 = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=16,
    intermediate_size=24,
    mlp_only_layers=[1],
    attention_bias=True,
    initializer_range=0.2,
    router_aux_loss_coef=0.05,
    output_router_logits=True,
)
# Mixtral: every layer MoE, no q/k norm; with the LM head tied to the embedding.
MIXTRAL = QWEN3.replace(model_type="mixtral", tie_word_embeddings=True)
# Fewer key/value heads than 4 ranks: under TP 4 each is copied on 2 ranks.
QWEN3_KV2 = QWEN3.replace(num_key_value_heads=2)


def micro_batch(seed=0, batch=4, seq=9):
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, QWEN3.vocab_size, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[1, 2:5] = -100
    return input_ids, labels


def build_with_biases(config):
    """The model with non-zero biases and sinks (biases start at zero), so that a row-parallel bias
    added on every rank, or a sink on the wrong head, would show; likewise DeepSeek-V3's
    correction bias (a buffer)."""
    model = build(config, seed=1)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(("bias", "sinks")):
                tensor.normal_(0.0, 0.2, generator=generator)
    return model


def kv_heads(model, name: str) -> int | None:
    """The key/value heads of the attention whose key or value projection (weight, bias, adapter)
    `name` is, in the whole `model`; None for any other name."""
    attention, _, rest = name.partition(".self_attn.")
    if not rest.startswith(("k_proj.", "v_proj.")):
        return None
    return model.get_submodule(f"{attention}.self_attn").num_kv_heads


def local_slice(name: str, full: torch.Tensor, rank: int, tp: int, heads: int | None = None) -> torch.Tensor:
    """This rank's part of a full parameter (or gradient), written out independently of the plans
    (every family's: test_parallel_families.py uses it too). `heads`: a key/value projection's
    (`kv_heads`); fewer than tp, each rank holds the one its query heads read, rank // (tp // heads)."""
    if heads is not None and heads < tp and name.endswith(("_proj.weight", "_proj.bias", "_proj.lora_B")):
        return full.chunk(heads, dim=0)[rank // (tp // heads)]
    if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_bias")):  # matching gate and up slices
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
    if name.endswith(("o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight", "experts.down_proj")):
        return full.chunk(tp, dim=-1)[rank]
    if name.endswith(
        (
            "q_proj.weight",
            "k_proj.weight",
            "v_proj.weight",
            "q_proj.bias",
            "k_proj.bias",
            "v_proj.bias",
            "self_attn.sinks",
            "q_b_proj.weight",
            "kv_b_proj.weight",
            "gate_proj.weight",
            "up_proj.weight",
            "embed_tokens.weight",
            "lm_head.weight",
        )
    ):
        return full.chunk(tp, dim=0)[rank]
    return full  # norms, router, o_proj bias, experts' down_proj_bias, latent projections: whole on every rank


def expert_slice(name: str, full: torch.Tensor, rank: int, ep: int) -> torch.Tensor:
    """This EP rank's experts of an expert bank (with its gradient), other parameters whole."""
    if not is_expert_parameter(name):
        return full
    sliced = full.detach().chunk(ep)[rank].requires_grad_()
    sliced.grad = full.grad.chunk(ep)[rank]
    return sliced


def check_matches_single_process(rank, config, dp, ep, tp):
    """The reference is one process in float64 (the same weights, cast): an fp32 one can round a
    value that sits within ~1e-6 of a kink — GPT-OSS's SwiGLU clamp, a top-k tie — to the other
    side from the layout's fp32, and their gradients then part by 1e-3. That happened for GPT-OSS
    under EP=4 on a CPU without AVX-512 (ATEN_CPU_CAPABILITY=avx2): the layout was within 7.5e-7
    of float64 and the fp32 reference 1.0e-3 away. Away from such a kink (GPT-OSS under EP=4, 40
    inputs, with and without AVX-512) the layout and one fp32 process are alike within 2.1e-6 of
    float64 in every gradient: RTOL = 1e-5 stands."""
    input_ids, labels = micro_batch(seed=dp * 10 + tp, batch=4 * dp * ep)
    reference = build_with_biases(config).double()
    ref_out = reference(input_ids, labels=labels)
    ref_out.loss.backward()

    mesh = init_mesh(ParallelDims(dp_replicate=dp, ep=ep, tp=tp))
    model = apply_data_parallel(apply_tp(apply_ep(build_with_biases(config), mesh), mesh), mesh)
    tp_rank, batch_rank = mesh.rank("tp"), mesh.rank("batch")
    rows = input_ids.shape[0] // (dp * ep)
    local = slice(batch_rank * rows, (batch_rank + 1) * rows)
    out = model(input_ids[local], labels=labels[local])
    loss = rank_loss(
        out.ce_loss,
        out.aux_loss,
        label_tokens(labels[local]),
        label_tokens(labels),
        config.router_aux_loss_coef,
        dp * ep,
    )
    loss.backward()
    reduce_gradients(model, mesh)
    comm.all_reduce_sum_([summed := loss.detach().clone()], mesh.group("batch"))

    assert rel_err(summed, ref_out.loss.detach()) <= RTOL
    assert rel_err(out.aux_loss, ref_out.aux_loss) <= RTOL
    ref_logits = ref_out.logits[local].detach().movedim(-1, 0)  # vocabulary first, as in lm_head.weight
    assert rel_err(out.logits, local_slice("lm_head.weight", ref_logits, tp_rank, tp).movedim(0, -1)) <= RTOL
    ref_params = {name: expert_slice(name, p, mesh.rank("ep"), ep) for name, p in reference.named_parameters()}
    for name, param in model.named_parameters():
        expected = local_slice(name, ref_params[name].grad, tp_rank, tp, kv_heads(reference, name))
        assert param.shape == expected.shape, name
        assert param.grad is not None and expected.norm() > 0, name
        assert rel_err(param.grad, expected) <= RTOL, name

    # Per rank: the sharded parameters' share, the replicated ones whole.
    expected_bytes = sum(
        local_slice(name, p, tp_rank, tp, kv_heads(reference, name)).numel() * 4 for name, p in ref_params.items()
    )
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == expected_bytes
    return True


@pytest.mark.parametrize(
    "config, dp, ep, tp",
    [
        (QWEN3, 1, 1, 4),
        (QWEN3, 2, 1, 2),
        (QWEN3, 1, 2, 2),
        (MIXTRAL, 1, 1, 4),
        (MIXTRAL, 2, 1, 2),
        (QWEN3_KV2, 1, 1, 4),
        (MIXTRAL.replace(num_key_value_heads=1), 1, 1, 4),
    ],
    ids=[
        "qwen3-tp4",
        "qwen3-dp2-tp2",
        "qwen3-ep2-tp2",
        "mixtral-tied-tp4",
        "mixtral-tied-dp2-tp2",
        "qwen3-kv2-tp4",
        "mixtral-kv1-tp4",
    ],
)
def test_tp_equals_one_process(pool, config, dp, ep, tp):
    """ep2-tp2: each EP rank's experts split again over TP (apply_tp after apply_ep, wrapping the
    all-to-all dispatcher). kv2-tp4, kv1-tp4: fewer key/value heads than ranks, each copied on
    2 or 4 ranks, their gradients summed over the copies (k/v biases and the k norm too)."""
    assert all(pool.run(check_matches_single_process, config, dp, ep, tp))


def check_collective_counts(rank):
    """Forward: one all-reduce for the embedding, one for attention and one for the MoE block (or
    dense MLP) of every layer, one for the loss's sum of exponentials and target logits (after
    one max). Backward: f's all-reduce at the attention input, at the MoE block's tokens and
    routing weights (or the dense MLP's input) and at the LM head. After backward: one all-reduce
    of every q/k norm gradient together."""
    mesh = init_mesh(ParallelDims(tp=WORLD))
    model = apply_tp(build(QWEN3, seed=1), mesh)
    input_ids, labels = micro_batch(seed=7, batch=2)
    layers = QWEN3.num_hidden_layers
    moe = sum(QWEN3.is_moe_layer(i) for i in range(layers))
    comm.reset_counts()
    out = model(input_ids, labels=labels, return_logits=False)
    forward, forward_bytes = dict(comm.calls), dict(comm.sent_bytes)
    out.loss.backward()
    backward = {key: n - forward.get(key, 0) for key, n in comm.calls.items()}

    assert out.logits.shape[-1] == QWEN3.vocab_size // WORLD  # the loss took this rank's vocabulary slice only
    embedding, loss = 1, 1
    assert forward == {("all_reduce", "forward"): embedding + 2 * layers + loss, ("all_reduce_max", "forward"): 1}, (
        forward
    )
    attention, head = 1, 1
    assert {k: v for k, v in backward.items() if v} == {
        ("all_reduce", "backward"): layers * attention + 2 * moe + (layers - moe) + head
    }, backward
    comm.reset_counts()
    reduce_gradients(model, mesh)
    qk_norms = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert dict(comm.calls) == {("grad_all_reduce", "step"): 1}
    assert dict(comm.sent_bytes) == {("grad_all_reduce", "step"): sum(p.numel() * 4 for p in qk_norms)}
    # Each block reduces [tokens, hidden] once; an all-reduce per expert slot (before the
    # routing-weight multiply) would move k times as much for every MoE block.
    tokens_bytes = input_ids.numel() * QWEN3.hidden_size * 4
    loss_bytes = 2 * input_ids.numel() * 4  # sum of exponentials and target logit per token
    assert forward_bytes[("all_reduce", "forward")] == (embedding + 2 * layers) * tokens_bytes + loss_bytes
    return True


def test_collective_counts_per_layer(pool):
    assert all(pool.run(check_collective_counts))


def check_copied_heads_reduce_once(rank):
    """2 key/value heads over 4 ranks: after backward one all-reduce of the q/k norms' gradients
    over tp and one of the copied k/v projections' (weights and biases) over the 2 ranks holding
    the same head — their size, not the whole projections'."""
    mesh = init_mesh(ParallelDims(tp=WORLD))
    model = apply_tp(build(QWEN3_KV2, seed=1), mesh)
    input_ids, labels = micro_batch(seed=7, batch=2)
    model(input_ids, labels=labels, return_logits=False).loss.backward()
    comm.reset_counts()
    reduce_gradients(model, mesh)
    copied = [p for p in model.parameters() if getattr(p, "tp_copies", 1) == 2]
    qk_norms = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(copied) == 4 * QWEN3_KV2.num_hidden_layers  # k and v, weight and bias
    assert all(p.shape[0] == QWEN3_KV2.attention_head_dim for p in copied)  # one head
    assert dict(comm.calls) == {("grad_all_reduce", "step"): 2}
    assert dict(comm.sent_bytes) == {("grad_all_reduce", "step"): sum(p.numel() * 4 for p in copied + qk_norms)}
    return True


def test_copied_heads_gradients_reduce_once_over_their_copies(pool):
    assert all(pool.run(check_copied_heads_reduce_once))


# ---- plan verification (before any collective, so in this process) --------------------------------

PLAN = family("mixtral").tp_plan(MIXTRAL)


@pytest.mark.parametrize(
    "plan, tp, message",
    [
        (
            {**PLAN, "model.layers.*.self_attn.qkv_proj": "colwise"},
            2,
            r"'model.layers.\*.self_attn.qkv_proj' .* nothing",
        ),
        (
            {k: v for k, v in PLAN.items() if "experts" not in k},
            2,
            "no entry for model.layers.0.mlp.experts.gate_up_proj",
        ),
        ({**PLAN, "lm_head": "colwise_rep"}, 2, "unknown style 'colwise_rep'"),
        (
            {**{k: v for k, v in PLAN.items() if "self_attn" not in k}, "model.layers.*.self_attn": "replicated"},
            3,
            r"tp=3: model.embed_tokens \(vocab\) has 64 rows on dim 0",
        ),
        (PLAN, 16, r"tp=16 must divide the 8 attention heads \(layer 0\)"),
        (
            {**PLAN, "model.layers.*.mlp.experts.gate_up_proj": "replicated"},
            2,
            r"experts.down_proj \(rowwise\) cannot take a Replicated\(\) input",
        ),
        ({**PLAN, "model.layers.*.self_attn.k_proj": "replicated"}, 2, "q_proj/k_proj/v_proj need one style"),
    ],
    ids=[
        "unmatched-entry",
        "experts-left-replicated",
        "unknown-style",
        "indivisible-vocab",
        "indivisible-query-heads",
        "mixed-expert-styles",
        "mixed-qkv-styles",
    ],
)
def test_bad_plan_is_fatal_and_leaves_the_model_whole(plan, tp, message):
    model = build(MIXTRAL.replace(tie_word_embeddings=False), seed=1)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=message):
        apply_tp(model, Mesh(ParallelDims(tp=tp), None), plan)
    assert {name: p.shape for name, p in model.named_parameters()} == shapes


def test_tp_neither_dividing_nor_a_multiple_of_the_key_value_heads_is_refused():
    """12 query heads over 6 ranks, but 4 key/value heads: neither split nor copied whole."""
    config = MIXTRAL.replace(num_attention_heads=12, num_key_value_heads=4, head_dim=4, tie_word_embeddings=False)
    model = build(config, seed=1)
    message = r"parallel.tp=6 must divide the 4 key/value attention heads or be a multiple of them \(layer 0\)"
    with pytest.raises(ConfigError, match=message):
        apply_tp(model, Mesh(ParallelDims(tp=6), None))
    assert model.model.layers[0].self_attn.k_proj.weight.shape[0] == 16  # untouched


@pytest.mark.parametrize(
    "config",
    [QWEN3.replace(mlp_only_layers=[]), QWEN3.replace(num_experts=0), MIXTRAL],
    ids=["qwen3-all-moe", "qwen3-dense", "mixtral"],
)
def test_family_plans_fit_their_models(config):
    """Each family's plan has entries for exactly what the config builds (no dense-MLP entries
    without dense layers, no q/k norm entries without q/k norms)."""
    model = apply_tp(build(config, seed=1), Mesh(ParallelDims(tp=2), None))  # no group: sharding only
    assert model.model.layers[0].self_attn.q_proj.weight.shape[0] == config.hidden_size // 2


def check_per_slot_reduce_moves_k_times_the_bytes(rank):
    """The alternative to the delayed all-reduce — reducing each expert slot's output before the
    routing-weight multiply (bench/parallel/tp_moe.py) — computes the same block but moves k× the bytes."""
    from bench.parallel.tp_moe import reduce_per_slot

    mesh = init_mesh(ParallelDims(tp=WORLD))
    config = QWEN3.replace(num_hidden_layers=1, mlp_only_layers=[])
    delayed = apply_tp(build(config, seed=3), mesh).model.layers[0].mlp
    per_slot = apply_tp(build(config, seed=3), mesh).model.layers[0].mlp
    reduce_per_slot(per_slot, mesh.group("tp"))
    x = torch.randn(10, config.hidden_size, generator=torch.Generator().manual_seed(4))
    outputs, sent = [], []
    for block in (delayed, per_slot):
        comm.reset_counts()
        outputs.append(block(x)[0])
        sent.append(comm.sent_bytes[("all_reduce", "forward")])
    assert rel_err(outputs[1], outputs[0]) <= 1e-5
    assert sent[0] == x.numel() * 4 and sent[1] == config.num_experts_per_tok * sent[0]
    return True


def test_per_slot_reduce_moves_k_times_the_bytes(pool):
    assert all(pool.run(check_per_slot_reduce_moves_k_times_the_bytes))


def check_activation_checkpointing(rank, mode):
    """EP 2 × TP 2 with activation checkpointing `mode`: the loss and every gradient of the same
    layout without it, bit for bit. Selective recomputation issues no collective again (backward
    communicates exactly what it does without checkpointing); full recomputation repeats the
    forward's all-to-alls and all-reduces in backward."""
    mesh = init_mesh(ParallelDims(ep=2, tp=2))
    input_ids, labels = micro_batch(seed=5, batch=4)
    rows = slice(mesh.rank("batch") * 2, mesh.rank("batch") * 2 + 2)
    results = []
    for checkpointing in ("none", mode):
        model = apply_data_parallel(apply_tp(apply_ep(build_with_biases(QWEN3), mesh), mesh), mesh)
        model.activation_checkpointing = checkpointing
        comm.reset_counts()
        out = model(input_ids[rows], labels=labels[rows], return_logits=False)
        forward = dict(comm.calls)
        comm.reset_counts()
        out.loss.backward()
        backward = dict(comm.calls)
        grads = {name: p.grad for name, p in model.named_parameters()}
        results.append((out.loss.detach(), grads, forward, backward))
    (loss, grads, forward, backward), (loss_ac, grads_ac, forward_ac, backward_ac) = results
    assert torch.equal(loss_ac, loss)
    assert all(torch.equal(grads_ac[name], grad) for name, grad in grads.items())
    assert forward_ac == forward
    if mode == "selective":
        assert backward_ac == backward, (backward_ac, backward)
    else:  # the layer runs again: its dispatch's all-gather too (torch's checkpoint stops recomputing
        # once every saved tensor is back, before the combine's all-to-all, whose sums nothing saves)
        assert backward_ac[("all_gather", "forward")] == forward[("all_gather", "forward")]
        assert backward_ac[("all_reduce", "backward")] == backward[("all_reduce", "backward")]
    return True


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_under_ep_and_tp(pool, mode):
    assert all(pool.run(check_activation_checkpointing, mode))


# ---- LoRA adapters in the layouts --------------------------------------------------------------------


def adapter_slice(name: str, full: torch.Tensor, rank: int, tp: int, heads: int | None = None) -> torch.Tensor:
    """This rank's part of a LoRA factor (or its gradient): B split by rows where its base is
    split by rows (colwise; the expert bank's gate and up halves alike), A by columns where its
    base is split by columns (rowwise); the other factor whole. A projection's follows its base's
    `local_slice`, so it does not restate the plans."""
    if name.endswith("experts.gate_up_proj_lora_B"):  # [E, 2I, r]: matching gate and up slices
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(tp, dim=1)[rank], up.chunk(tp, dim=1)[rank]], dim=1)
    if name.endswith("experts.down_proj_lora_A"):  # [E, r, I]: the bank's columns
        return full.chunk(tp, dim=-1)[rank]
    if name.endswith(("experts.gate_up_proj_lora_A", "experts.down_proj_lora_B")):
        return full
    module, _, factor = name.rpartition(".")
    if factor == "lora_B" and heads is not None and heads < tp:  # a copied key/value head's rows
        return local_slice(name, full, rank, tp, heads)
    probe = local_slice(f"{module}.weight", torch.zeros(2 * tp, 2 * tp), rank, tp)
    if factor == "lora_B" and probe.shape[0] < 2 * tp:
        return full.chunk(tp, dim=0)[rank]
    if factor == "lora_A" and probe.shape[1] < 2 * tp:
        return full.chunk(tp, dim=-1)[rank]
    return full


def check_lora_matches_single_process(rank, config, targets, dp, ep, tp):
    """Loss and every trained tensor's gradient (adapters; a router named in the targets) of a
    LoRA model laid out for dp × ep × tp, against one process in float64 (as
    check_matches_single_process: an fp32 one was 1.04e-5 from qwen3-kv2-tp4's fp32 q_proj.lora_B
    gradient on an AVX-512 CPU, a small gradient summed over the copied heads' ranks), sliced to
    this rank's part."""
    from moemesh.models.lora import LoraConfig, is_adapter
    from test_lora import lora_model

    lora = LoraConfig(rank=4, alpha=8.0, targets=targets)
    input_ids, labels = micro_batch(seed=11 + tp, batch=4 * dp * ep)
    reference = lora_model(config, lora).double()
    ref_out = reference(input_ids, labels=labels)
    ref_out.loss.backward()
    # Past the key/value heads (tp > kv heads) a copied head's gradients are summed over its ranks:
    # qwen3-kv2-tp4's fp32 q_proj.lora_B (a small gradient) was 1.14e-5 from float64 on an AVX-512
    # Xeon (2026-12-01; 1.04e-5 on the CPU the docstring names; one fp32 process: 2.6e-6): 2 × RTOL.
    tolerance = 2 * RTOL if tp > config.num_key_value_heads else RTOL

    mesh = init_mesh(ParallelDims(dp_replicate=dp, ep=ep, tp=tp))
    model = apply_data_parallel(apply_tp(apply_ep(lora_model(config, lora), mesh), mesh), mesh)
    rows = input_ids.shape[0] // (dp * ep)
    local = slice(mesh.rank("batch") * rows, (mesh.rank("batch") + 1) * rows)
    out = model(input_ids[local], labels=labels[local])
    loss = rank_loss(
        out.ce_loss,
        out.aux_loss,
        label_tokens(labels[local]),
        label_tokens(labels),
        config.router_aux_loss_coef,
        dp * ep,
    )
    loss.backward()
    reduce_gradients(model, mesh)
    comm.all_reduce_sum_([summed := loss.detach().clone()], mesh.group("batch"))
    assert rel_err(summed, ref_out.loss.detach()) <= RTOL

    ref_params = {
        name: expert_slice(name, p, mesh.rank("ep"), ep) for name, p in reference.named_parameters() if p.requires_grad
    }
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert trained.keys() == {name for name, p in reference.named_parameters() if p.requires_grad}
    assert sum(is_adapter(name) for name in trained) > 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, name  # the base stays frozen in every layout
            continue
        full = ref_params[name].grad
        expected = (
            adapter_slice(name, full, mesh.rank("tp"), tp, kv_heads(reference, name))
            if is_adapter(name)
            else local_slice(name, full, mesh.rank("tp"), tp, kv_heads(reference, name))
        )
        assert param.shape == expected.shape, name
        assert expected.norm() > 0 and rel_err(param.grad, expected) <= tolerance, name
    return True


@pytest.mark.parametrize(
    "family, dp, ep, tp",
    [
        ("qwen3", 1, 1, 4),
        ("qwen3", 2, 1, 2),
        ("qwen3", 1, 2, 2),
        ("qwen3", 1, 4, 1),
        ("deepseek_v3", 1, 2, 2),
        ("qwen3_kv2", 1, 1, 4),
    ],
    ids=["qwen3-tp4", "qwen3-dp2-tp2", "qwen3-ep2-tp2", "qwen3-ep4", "deepseek_v3-ep2-tp2", "qwen3-kv2-tp4"],
)
def test_lora_equals_one_process(pool, family, dp, ep, tp):
    """Adapters on attention, the dense layer's MLP and every expert (DeepSeek: latent attention,
    the shared experts, and the routers trained in full): under EP each expert's factors live with
    it, under TP they split with their base (B by rows under colwise and packed_colwise, A by
    columns under rowwise), and every layout gives one process's gradients. qwen3-kv2-tp4: the
    B factors of copied key/value heads are copied with them, their gradients summed over the copies."""
    from test_activation_checkpointing import DEEPSEEK_V3
    from test_lora import DEEPSEEK_TARGETS, QWEN3_TARGETS

    configs = {"qwen3": (QWEN3, QWEN3_TARGETS), "qwen3_kv2": (QWEN3_KV2, QWEN3_TARGETS)}
    config, targets = configs.get(family, (DEEPSEEK_V3, DEEPSEEK_TARGETS))
    assert all(pool.run(check_lora_matches_single_process, config, targets, dp, ep, tp))


def check_adapter_merged_per_shard(rank, base, adapter):
    """`load_for_generation(..., adapter=)` under TP 4: each rank merges its shard of every adapter
    into its shard of the weights; the logits are one process's (this rank's vocabulary slice)."""
    from moemesh.inference.generate import load_for_generation

    input_ids, _ = micro_batch(seed=4, batch=2)
    whole, _ = load_for_generation(base, device="cpu", dtype=torch.float32, adapter=adapter)
    mesh = init_mesh(ParallelDims(tp=WORLD))
    sharded, _ = load_for_generation(base, device="cpu", dtype=torch.float32, mesh=mesh, adapter=adapter)
    with torch.no_grad():
        expected = whole(input_ids).logits.movedim(-1, 0)
        ours = sharded(input_ids).logits
    assert not any("lora" in name for name, _ in sharded.named_parameters())
    assert rel_err(ours, local_slice("lm_head.weight", expected, mesh.rank("tp"), WORLD).movedim(0, -1)) <= RTOL
    return True


def test_generation_merges_adapters_per_shard(pool, tmp_path):
    from moemesh.checkpoint.adapters import Adapter, write_peft
    from moemesh.checkpoint.hf import save_pretrained
    from moemesh.models.lora import LoraConfig, is_adapter
    from test_lora import lora_model

    config = QWEN3.replace(mlp_only_layers=[])
    model = lora_model(config, LoraConfig(rank=4, alpha=8.0))
    tensors = {name: p.detach() for name, p in model.named_parameters() if is_adapter(name)}
    targets = {}  # adapted name (a projection, or an expert bank) -> (rank, alpha)
    for name in tensors:
        owner = name.removesuffix("_lora_A").removesuffix("_lora_B") if ".experts." in name else name.rsplit(".", 1)[0]
        targets[owner] = (4, 8.0)
    base = {name: t for name, t in model.state_dict().items() if not is_adapter(name)}
    plain = build(config)
    plain.load_state_dict(base)
    save_pretrained(plain, tmp_path / "base")
    write_peft(Adapter(targets, tensors), config, tmp_path / "adapter")
    assert all(pool.run(check_adapter_merged_per_shard, str(tmp_path / "base"), str(tmp_path / "adapter")))
