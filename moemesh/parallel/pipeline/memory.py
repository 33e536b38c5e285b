"""What each item of the model (embedding, decoder layers, head) costs a pipeline stage: measured
by running it, or estimated from the config.

Measured (`profile_layers`): run one forward and backward item by item, each item's input cut
from the graph (`detach().requires_grad_()`) so that its backward can be run and timed on its own.
While an item's forward runs, `saved_tensors_hooks` sees every tensor autograd keeps for the
backward. A saved tensor whose storage is a parameter's is a weight (already counted with the
parameters); anything else is activation memory, held once per micro-batch in flight. Each
storage counts once per item, at its full size (a saved view keeps its whole storage alive).

Estimated (`estimate_layer_costs`): the same bytes from the shapes, following what moemesh saves
on the kernel path (Triton ops, flash-style attention). With T tokens, activation dtype size b,
residual-stream dtype size r (the weights' dtype: 4 for fp32 weights under bf16 autocast, else b),
H hidden, Q = heads x head_dim, K = kv heads x head_dim, k = experts per token, E experts,
I the expert (or dense MLP) width, V the vocabulary:

    RMSNorm     n*w*c + 4n over n rows of width w: its input as given, in its dtype c (r for the
                norms of the residual stream, b for the q/k norms), and the fp32 rsqrt per row
                (the fused op recomputes the normalised rows; the output is counted where a
                consumer saves it)
    attention   norm(T, H) + its output, which q/k/v save, T*H*b (three copies when r != b: each
                projection casts it for itself) + with qk-norm norm(T*heads, D) + norm(T*kv
                heads, D) + cos and sin 2*seq_len*D*r + SDPA's rotated q and k, v and output
                T*(2Q + 2K)*b and log-sum-exp 4*T*heads (RoPE's products save only cos and sin;
                o_proj's input is a view of SDPA's output)
    MoE         norm(T, H) + its output T*H*b + router probabilities 4*T*E + top-k ids 8*T*k and
                weights 4*T*k (`ops/topk_softmax.routed`: renormalised or not, the same)
                + permute positions 8*T*k + expert input, gate|up output, SwiGLU output and
                expert output T*k*(2H + 3I)*b + group sizes 8*E (+ when r != b the router
                weight's cast copy E*H*b)
    dense MLP   norm(T, H) + its output T*H*b (two copies when r != b) + gate, up, silu(gate),
                product 4*T*I*b
    embedding   the token ids, 8*T
    head        norm(T, H) + the fused cross-entropy's precomputed gradients of the hidden states
                T*H*b and of the head weight V*H*b (never the logits)

Beside the items' saved tensors a stage keeps, per micro-batch in flight, its output T*H*r until
its backward (`LayerCost.output_bytes`, counted for a stage that does not end with the head); and
the head needs, once, while its forward runs, the fused cross-entropy's fp32 weight-gradient
accumulator 4*V*H and a logits chunk (`LayerCost.working_bytes`; 1.7 GiB at a 152k vocabulary and
hidden 2048). A measured profile leaves working memory out.

Off the kernel path (PyTorch reference ops, the default on CPU) the saved tensors differ: the
reference cross-entropy keeps full logits, for one. Under autocast the projections and expert
GEMMs save their weights as they are and cast them again in backward (`ops/linear.py`,
`ops/grouped_mm.py`), so no bf16 weight copy is held per micro-batch but the router's small one,
and LoRA's factors (cast once a forward, `ops/low_rank.py`: 2 bytes a trained parameter, left out).

Time is forward + backward FLOPs: 6 per multiplying parameter per token, plus attention.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moemesh.models.build import meta_model
from moemesh.models.config import ModelConfig
from moemesh.models.moe import EXPERT_BANKS, Experts
from moemesh.models.transformer import MoECausalLM
from moemesh.ops.linear import Linear
from moemesh.ops.linear_cross_entropy import LOGITS_CHUNK_ELEMENTS
from moemesh.parallel.config import ParallelConfig, StepShape
from moemesh.parallel.expert import apply_ep, is_expert_parameter
from moemesh.parallel.fsdp import shard_dim
from moemesh.parallel.mesh import Mesh, ParallelDims
from moemesh.parallel.pipeline.partition import LayerCost, partition
from moemesh.parallel.pipeline.schedule import Schedule, peak_in_flight
from moemesh.parallel.tensor import apply_tp


@dataclass(frozen=True)
class LayerProfile:
    name: str
    params: int  # parameters of the item (a tied embedding/head weight counts with the embedding)
    weight_bytes: int  # saved tensors that are parameters
    activation_bytes: int  # everything else saved for backward
    seconds: float  # forward + backward wall clock
    output_bytes: int  # the item's output (a stage ending here keeps it per micro-batch in flight)


def profile_layers(model: MoECausalLM, input_ids: torch.Tensor, labels: torch.Tensor) -> list[LayerProfile]:
    """One forward and backward of `model` on one micro-batch, measured item by item."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    items: list[tuple[str, Callable]] = [("embedding", model.model.embed_tokens)]
    items += [
        (f"layer {i}", lambda h, i=i: model.run_layers(h, positions, [i])[0]) for i in range(len(model.model.layers))
    ]
    items.append(("head", lambda h: model.head(model.model.norm(h), labels, return_logits=False)[1]))

    # Forward, item by item, each input a fresh leaf.
    runs = []  # (input leaf or None, output, saved bytes by kind, forward seconds)
    h = input_ids
    for name, forward in items:
        leaf = h if name == "embedding" else h.detach().requires_grad_()
        saved = _SavedBytes(parameter_storages)
        start = _clock(h)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda x: x):
            out = forward(leaf)
        seconds = _clock(h) - start
        runs.append((leaf, out, saved, seconds))
        h = out

    # Backward, last item first, each fed its output's gradient.
    backward_seconds, grad = [], None
    for leaf, out, _, _ in reversed(runs):
        start = _clock(out)
        out.backward(grad)
        backward_seconds.insert(0, _clock(out) - start)
        grad = leaf.grad if leaf.is_floating_point() else None
    return [
        LayerProfile(
            name,
            params,
            saved.weight_bytes,
            saved.activation_bytes,
            forward + backward,
            out.numel() * out.element_size(),
        )
        for (name, _), params, (_, out, saved, forward), backward in zip(
            items, _item_params(model), runs, backward_seconds
        )
    ]


def _item_params(model: MoECausalLM) -> list[int]:
    """Parameters per item, in item order; a tied head weight counts once, with the embedding."""
    return [sum(p.numel() for _, p in item) for item in _items(model)]


def _items(model: MoECausalLM) -> list[list[tuple[str, torch.Tensor]]]:
    """(name, parameter) of each item, in item order; a tied head weight once, with the embedding."""
    names = {id(p): name for name, p in model.named_parameters()}
    modules = [
        [model.model.embed_tokens],
        *[[layer] for layer in model.model.layers],
        [model.model.norm, model.lm_head],
    ]
    seen: set[int] = set()
    items = []
    for group in modules:
        params = [p for module in group for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        items.append([(names[id(p)], p) for p in params])
    return items


def rank_param_counts(
    config: ModelConfig, parallel: ParallelConfig, quantized: str = "", dtype_bytes: int = 2
) -> list[float]:
    """Parameters one rank keeps of each item under the expert, tensor and fully sharded
    parallelism of `parallel`: the model laid out by EP and TP on the meta device (rank 0's view;
    the others' differ by rounding at most), each tensor that FSDP splits counted at its share.
    `quantized` (a LoRA run's base kept in "fp8" or "mxfp4", `checkpoint/quantized_base.py`): the
    weights the format stores count at their bytes' share of `dtype_bytes` (fp8: 1 B and a 4-byte
    scale a row's 128 columns; mxfp4, the experts alone: half a byte and one a 32-group)."""
    dims = ParallelDims(dp_replicate=parallel.dp_replicate, dp_shard=parallel.dp_shard, ep=parallel.ep, tp=parallel.tp)
    mesh = Mesh(dims, None)  # shapes only: no process groups
    model = apply_tp(apply_ep(meta_model(config), mesh), mesh)
    stored = quantized_names(meta_model(config), quantized) if quantized else set()  # before the layout
    share = QUANTIZED_BYTES.get(quantized, dtype_bytes) / dtype_bytes
    counts = []
    for item in _items(model):
        count = 0.0
        for name, param in item:
            parts = dims.dp_shard if is_expert_parameter(name) else dims.dp_shard * dims.ep
            split = dims.dp_shard > 1 and shard_dim(name, param, dims) is not None
            count += (param.numel() / parts if split else param.numel()) * (share if name in stored else 1.0)
        counts.append(count)
    return counts


QUANTIZED_BYTES = {"fp8": 1 + 4 / 128, "mxfp4": 0.5 + 1 / 32}  # a weight's bytes a parameter, scales in


def quantized_names(model: nn.Module, quantized: str) -> set[str]:
    """The weights a published checkpoint of `quantized` stores so: fp8, every projection and
    expert bank (not the head, the embeddings, norms or routers); mxfp4, the expert banks."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, Experts):
            names.update(f"{prefix}.{bank}" for bank in EXPERT_BANKS)
        elif quantized == "fp8" and isinstance(module, Linear) and not prefix.endswith("lm_head"):
            names.add(f"{prefix}.weight")
    return names


def profile_costs(
    profiles: list[LayerProfile], state_bytes_per_param: int = 16, rank_params: list[float] | None = None
) -> list[LayerCost]:
    """LayerCosts from measured profiles, each parameter keeping `state_bytes_per_param` bytes
    (weight, gradient and optimizer state; 16 for fp32 AdamW); `rank_params`: the parameters a
    rank keeps of each item under its layout (`rank_param_counts`), else all of them."""
    rank_params = rank_params or [p.params for p in profiles]
    return [
        LayerCost(p.name, kept * state_bytes_per_param, p.activation_bytes, p.seconds, p.output_bytes)
        for p, kept in zip(profiles, rank_params)
    ]


def estimate_layer_costs(
    config: ModelConfig,
    tokens: int,
    dtype_bytes: int = 2,
    state_bytes_per_param: int = 16,
    shard: int = 1,
    seq_len: int | None = None,
    residual_bytes: int | None = None,
    rank_params: list[float] | None = None,
    ep: int = 1,
    ep_capacity: float | None = None,
) -> list[LayerCost]:
    """Analytical LayerCosts for micro-batches of `tokens` tokens in sequences of `seq_len`
    (default: one sequence); time is forward + backward FLOPs. `residual_bytes`: the weights'
    dtype size (default: dtype_bytes). `rank_params`: the parameters a rank keeps of each item
    (default: the formula's, over `shard` ranks). See the module docstring."""
    r = residual_bytes or dtype_bytes
    rows = estimate_layers(config, tokens, dtype_bytes, seq_len, r, ep, ep_capacity)
    rank_params = rank_params or [params / shard for _, params, _, _ in rows]
    return [
        LayerCost(
            name,
            kept * state_bytes_per_param,
            activations,
            flops,
            0.0 if name == "head" else tokens * config.hidden_size * r,
            head_working_bytes(config, tokens, dtype_bytes) if name == "head" else 0.0,
        )
        for (name, _, activations, flops), kept in zip(rows, rank_params)
    ]


def head_working_bytes(config: ModelConfig, tokens: int, dtype_bytes: int) -> float:
    """What the fused cross-entropy holds while the head's forward runs: the fp32 [V, H]
    weight-gradient accumulator and one logits chunk (`ops/linear_cross_entropy.py`)."""
    vocab = config.vocab_size
    chunk_tokens = min(tokens, max(1, LOGITS_CHUNK_ELEMENTS // vocab))
    return 4 * vocab * config.hidden_size + chunk_tokens * vocab * dtype_bytes


def expert_rows(config: ModelConfig, tokens: int, ep: int = 1, ep_capacity: float | None = None) -> int:
    """Rows of a rank's expert buffer for `tokens` tokens a rank: the routed pairs (T·k, their
    mean under exact all-to-all splits), or under the gathering EP dispatcher its capacity
    (`parallel/expert.py`: ep_capacity × T·k, at most every possible pair)."""
    k = config.num_experts_per_tok
    if ep == 1 or ep_capacity is None:
        return tokens * k
    return min(ep * tokens * min(k, config.num_experts // ep), math.ceil(ep_capacity * tokens * k))


def estimate_layers(
    config: ModelConfig,
    tokens: int,
    dtype_bytes: int = 2,
    seq_len: int | None = None,
    residual_bytes: int | None = None,
    ep: int = 1,
    ep_capacity: float | None = None,
) -> list[tuple[str, int, float, float]]:
    """(name, parameters, activation bytes per micro-batch, forward + backward FLOPs) per item.
    `ep`, `ep_capacity`: the gathering EP dispatcher's (`expert_rows`); it also keeps the
    positions and routing weights of the pairs of every rank's tokens."""
    T, b, H, V = tokens, dtype_bytes, config.hidden_size, config.vocab_size
    r = residual_bytes or dtype_bytes
    D, heads, kv_heads = config.attention_head_dim, config.num_attention_heads, config.num_key_value_heads
    Q, K = heads * D, kv_heads * D
    k, E = config.num_experts_per_tok, config.num_experts
    seq = seq_len or T
    context = min(seq, config.sliding_window or seq)

    def norm(rows: int, width: int, input_bytes: int = r) -> float:
        return rows * width * input_bytes + 4 * rows

    attention_matmul = H * (Q + 2 * K) + Q * H  # q, k, v, o
    attention_params = attention_matmul + 2 * H  # and the two layer norms
    projection_inputs = (3 if r != b else 1) * T * H * b
    attention_acts = norm(T, H) + projection_inputs + 2 * seq * D * r + T * (2 * Q + 2 * K) * b + 4 * T * heads
    if config.qk_norm:
        attention_params += 2 * D
        attention_acts += norm(T * heads, D, b) + norm(T * kv_heads, D, b)
    if config.attention_bias:
        attention_params += Q + 2 * K + H
    attention_flops = 6 * T * attention_matmul + 6 * T * context * Q  # scores and values, causal: half of 12

    rows = [("embedding", V * H, 8 * T, 0.0)]
    for i in range(config.num_hidden_layers):
        if config.is_moe_layer(i):
            inter = config.moe_intermediate_size
            mlp_params = E * 3 * H * inter + E * H
            mlp_flops = 6 * T * (k * 3 * H * inter + E * H)
            gathered = ep > 1 and ep_capacity is not None  # positions and weights of every rank's pairs
            pairs = ep * T * k if gathered else T * k
            mlp_acts = norm(T, H) + T * H * b + 4 * T * E + 12 * T * k + 8 * pairs + (4 * pairs if gathered else 0)
            mlp_acts += expert_rows(config, T, ep, ep_capacity) * (2 * H + 3 * inter) * b
            mlp_acts += 8 * E + (E * H * b if r != b else 0)  # group sizes; the router weight's cast copy
        else:
            inter = config.intermediate_size
            mlp_params = 3 * H * inter
            mlp_flops = 6 * T * mlp_params
            mlp_acts = norm(T, H) + (2 if r != b else 1) * T * H * b + 4 * T * inter * b  # gate and up cast apart
        rows.append(
            (f"layer {i}", attention_params + mlp_params, attention_acts + mlp_acts, attention_flops + mlp_flops)
        )
    head_params = H + (0 if config.tie_word_embeddings else V * H)
    rows.append(("head", head_params, norm(T, H) + T * H * b + V * H * b, 6.0 * T * V * H))
    return rows


class _SavedBytes:
    """A saved_tensors_hooks pack hook that sums the storages it sees, each once."""

    def __init__(self, parameter_storages: set[int]):
        self.parameter_storages = parameter_storages
        self.seen: set[int] = set()
        self.weight_bytes = self.activation_bytes = 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.seen:
            self.seen.add(pointer)
            if pointer in self.parameter_storages:
                self.weight_bytes += storage.nbytes()
            else:
                self.activation_bytes += storage.nbytes()
        return tensor


def _clock(tensor: torch.Tensor) -> float:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


# ---- a run's costs (the `moemesh estimate` report is moemesh/estimate.py) ----------------------------

# Per parameter: fp32 weight and gradient, AdamW's two fp32 moments.
ADAMW_STATE_BYTES = 16


def rank_tokens(parallel: ParallelConfig, step: StepShape) -> int:
    """Tokens one rank runs per micro-batch: the micro-batch is split over the data-parallel ranks."""
    return step.micro_batch * step.seq_len // parallel.batch_ranks


def state_bytes_per_param(step: StepShape) -> int:
    """Weight, gradient and AdamW's two moments: fp32 (16 B), or bf16 with train.param_dtype (8 B).
    Under LoRA (`step.frozen_base`) the frozen base's weight alone, in the compute dtype (2 B in
    bf16, 4 in fp32); the adapters' state (well under 1% of it) is left out."""
    if step.frozen_base:
        return 2 if step.dtype == "bfloat16" else 4
    return ADAMW_STATE_BYTES // 2 if step.param_dtype == "bfloat16" else ADAMW_STATE_BYTES


def run_costs(config: ModelConfig, parallel: ParallelConfig, step: StepShape) -> list[LayerCost]:
    """The analytical per-item costs of one rank of a run: the parameter state AdamW keeps of what
    the rank holds under EP, TP and FSDP (`rank_param_counts`), the activations of its share of a
    micro-batch (under TP as without it: an overestimate)."""
    dtype_bytes = 2 if step.dtype == "bfloat16" else 4
    residual_bytes = 2 if step.param_dtype == "bfloat16" else 4
    ep_capacity = parallel.ep_capacity if parallel.ep_dispatch == "gather" else None
    tokens = rank_tokens(parallel, step)
    costs = estimate_layer_costs(
        config,
        tokens,
        dtype_bytes,
        state_bytes_per_param(step),
        seq_len=step.seq_len,
        residual_bytes=residual_bytes,
        rank_params=rank_param_counts(config, parallel, step.quantized_base, dtype_bytes),
        ep=parallel.ep,
        ep_capacity=ep_capacity,
    )
    return with_recomputation(
        costs,
        step.activation_checkpointing,
        config,
        tokens,
        dtype_bytes,
        residual_bytes,
        expert_rows(config, tokens, parallel.ep, ep_capacity),
    )


def with_recomputation(
    costs: list[LayerCost],
    mode: str,
    config: ModelConfig,
    tokens: int,
    dtype_bytes: int,
    residual_bytes: int,
    rows: int | None = None,
) -> list[LayerCost]:
    """The decoder layers' costs under activation checkpointing (`ops/recompute.py`): a layer keeps
    its input T*H*r per micro-batch in flight and, selective, its matmul outputs (q/k/v/o T*(Q + 2K
    + H)*b; MoE gate|up and down T*k*(2I + H)*b, the shared experts' alike; dense MLP T*(2I + H)*b);
    what it saved before is needed once, while its backward recomputes (working bytes). Full
    recomputation adds a forward: a third of the forward + backward FLOPs. `rows`: the expert
    buffer's (`expert_rows`; default T·k). Under EP the kept collectives' results are left out (an
    underestimate for selective)."""
    if mode == "none":
        return costs
    T, b, H = tokens, dtype_bytes, config.hidden_size
    Q, K = (
        config.num_attention_heads * config.attention_head_dim,
        config.num_key_value_heads * config.attention_head_dim,
    )
    out = []
    for cost in costs:
        if not cost.name.startswith("layer "):
            out.append(cost)
            continue
        i, kept = int(cost.name.split()[1]), T * H * residual_bytes
        if mode == "selective":
            kept += T * (Q + 2 * K + H) * b
            if config.is_moe_layer(i):
                kept += (rows or T * config.num_experts_per_tok) * (2 * config.moe_intermediate_size + H) * b
                if config.n_shared_experts:
                    kept += T * (2 * config.moe_intermediate_size * config.n_shared_experts + H) * b
            else:
                kept += T * (2 * config.intermediate_size + H) * b
        time = cost.time * 4 / 3 if mode == "full" else cost.time
        working = cost.working_bytes + cost.activation_bytes
        out.append(
            dataclasses.replace(
                cost, activation_bytes=min(kept, cost.activation_bytes), time=time, working_bytes=working
            )
        )
    return out


def stage_ranges(schedule: Schedule, costs: list[LayerCost]) -> list[range]:
    """The items of each stage of `schedule`: the least peak memory per rank at balanced time."""
    return partition(costs, schedule.num_stages, peak_in_flight(schedule), list(schedule.stage_rank))
