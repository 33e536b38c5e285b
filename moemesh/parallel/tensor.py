"""Tensor parallelism: every rank of the tp group holds a slice of each large weight and computes
its share of the layer; collectives join the shares. Applied to a built full model, identical on
every rank, by the model family's plan (module or parameter path pattern -> style):

    colwise          Linear split on its output features (q/k/v, dense gate/up): each rank gets
                     its own heads or columns
    rowwise          Linear split on its input features (o_proj, dense down): the product is a
                     partial sum, all-reduced, then the bias is added once. On the expert bank's
                     down_proj [E, H, I] (split on I) and on the shared experts' down_proj
                     (DeepSeek) the partial is not reduced there but at the end of the MoE
                     block's combine, once per block
    packed_colwise   the expert bank's fused gate_up_proj [E, 2I, H] (and its bias [E, 2I]): each
                     rank keeps the same slice of the gate rows and of the up rows, so SwiGLU
                     stays local
    partial_bias     the expert bank's down_proj_bias [E, H], added to the partial expert outputs
                     before the block's one reduce: each rank adds bias / tp, so the reduce adds
                     it once; its gradient (1/tp of the whole on each rank) is tagged like
                     replicated_with_grad_allreduce's and summed over tp after backward
    vocab            embedding and LM head split on the vocabulary: a masked lookup plus one
                     all-reduce; the loss is a vocabulary-parallel cross-entropy
    replicated       the router: every rank routes its (identical) tokens identically
    replicated_with_grad_allreduce
                     a weight applied to this rank's shard only (Qwen3's per-head q/k norms):
                     its gradient is a partial sum, tagged `partial_grad_axis = "tp"` and
                     summed over tp with the other gradients after backward (`reduce_gradients`)

Attention splits by heads: each rank keeps num_heads / tp query heads and num_kv_heads / tp
key/value heads. Where tp exceeds the key/value heads (Gemma-4 26B-A4B's full layers have 2, at tp=4)
and is a multiple of them, each rank keeps instead a copy of the one key/value head that its query
heads read — head rank // (tp // num_kv_heads), as vLLM, SGLang and Megatron do: its k_proj/v_proj
rows (and their biases, their LoRA B rows) are that head's, the same on tp // num_kv_heads
consecutive ranks, and the attention's num_kv_heads becomes 1, so that the KV cache (sized from the
keys it is given) holds one head a layer. Such a copy's gradient on each rank is partial (only that
rank's query heads read it); `reduce_gradients` sums it over the ranks holding the same head — a
process group of its own (`Mesh.tp_copies`: tp unflattened into (tp_heads, tp_copies)), which is
exact and moves only the head's gradient; an all-reduce over all of tp would add different heads
together. A weight applied to every head alike (Gemma's and Qwen3's k_norm) stays
replicated_with_grad_allreduce: the sum of every rank's partial is still its gradient. The gradient
norm counts each copy once; a checkpoint presents the copies as split over tp_heads and replicated
over tp_copies (`stored.py`), so DCP writes each head once and reads it into every copy, in any
layout. A tp that divides the query heads but neither divides nor is a multiple of the key/value
heads is a ConfigError. Limit: tp must divide the query heads, so a rank never needs two
key/value heads.

Megatron's f (identity forward, all-reduce backward) sits where a replicated tensor enters
sharded compute: the attention / dense-MLP input, the experts' input tokens and the routing
weights (they multiply partial expert outputs, so their gradient is partial too). g (all-reduce
forward, identity backward) sits where partial sums become replicated again: after o_proj and
the dense down_proj, and once per MoE block after combine — routing-weight multiply and top-k sum
are linear, so they run on the partial expert outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from moemesh.errors import ConfigError
from moemesh.models.adapted import adapted_linear, has_adapter
from moemesh.models.attention_mla import MLAttention
from moemesh.models.layers import Attention, DenseMLP
from moemesh.models.lora import is_adapter
from moemesh.models.moe import MoEBlock
from moemesh.models.registry import family
from moemesh.models.transformer import MoECausalLM, shift_labels
from moemesh.ops import summed_norm
from moemesh.ops.linear import linear
from moemesh.parallel import comm
from moemesh.parallel.expert import share_experts
from moemesh.parallel.mesh import Mesh
from moemesh.parallel.pieces import record_piece
from moemesh.parallel.placement import Op, place_reduce
from moemesh.parallel.stored import packed_dim


def apply_tp(model: MoECausalLM, mesh: Mesh, plan: dict[str, str] | None = None) -> MoECausalLM:
    """Shard `model` in place over the tp axis by `plan` (default: its family's). The plan is
    checked whole before anything changes: an entry that matches nothing, an unknown style, a
    matrix that no entry covers, a region whose styles do not fit together (`place_reduce`), or a
    size that tp does not divide (key/value heads: nor is a multiple of) is a ConfigError. Under
    expert parallelism call it after `apply_ep`: it wraps the block's (all-to-all) dispatcher."""
    tp, group = mesh.dims.tp, mesh.group("tp")
    if tp == 1:
        return model
    if plan is None:
        plan = family(model.config.model_type).tp_plan(model.config)
    targets = _resolve(model, plan)
    # Regions (attention, dense MLP, MoE block) that the plan shards, i.e. that need a reduce.
    regions = [region for region, chain in _regions(model, dict(targets)) if _reduce_at(region, chain) is not None]
    kv_heads = _kv_heads(model, regions, tp)
    _check(model, targets, tp, kv_heads)
    for copies in sorted({tp // heads for heads in kv_heads.values()}):
        mesh.tp_copies(copies)  # its groups, made on every rank in one order
    shard = _Sharder(mesh.rank("tp"), tp, kv_heads)
    for name, style in targets:
        _APPLY[style](model, name, shard, group)
    for region in regions:
        _enter_sharded(region, group, tp)
    _reduce_branches_once(model, regions, group)
    model.tie_weights()
    return model


def apply_tp_whole_experts(model: MoECausalLM, mesh: Mesh) -> MoECausalLM:
    """Tensor parallelism for an engine, its experts whole: attention, dense layers and vocabulary
    split over the tp ranks as `apply_tp` splits them, and each MoE layer's experts split among the
    same ranks by expert (E/tp whole experts a rank) rather than each expert's intermediate rows —
    vLLM's `--enable-expert-parallel`. Every rank holds the step's tokens (attention's all-reduce
    gives them), computes its experts' share of each (`ReplicatedTokensDispatcher`: a decode step
    through the decoding kernels on its own experts) and the block's one all-reduce adds the
    shares, as the sliced layout's does. Why: a tp slice of an expert is narrow (192 of 768
    intermediate rows at tp=4) and reads below the copy rate; whole experts read at 93% of it. On
    H200s a decode step at batch 64 ran 1.06-1.07x faster than with slices at tp=2 and 4, and
    slower at batch 1 (a token's 8 experts fall unevenly on the ranks; docs/benchmarks.md,
    2026-11-28, fourth session). Refuses DeepSeek's shared experts."""
    if mesh.dims.tp == 1:
        return model
    share_experts(model, mesh.dims.tp, mesh.rank("tp"), mesh.group("tp"), "parallel.tp")
    for block in model.modules():  # a checkpoint places each rank's experts on dim 0 over tp
        if isinstance(block, MoEBlock):
            for param in block.experts.parameters(recurse=False):
                param.tp_dim = 0
    plan = family(model.config.model_type).tp_plan(model.config)
    plan = {pattern: "replicated" if ".mlp.experts." in pattern else style for pattern, style in plan.items()}
    return apply_tp(model, mesh, plan)  # the experts this rank keeps stay whole


def _reduce_branches_once(model: nn.Module, regions: list[nn.Module], group) -> None:
    """A layer with two sharded branches side by side (Gemma 4: a dense MLP beside the experts,
    each normalised after its sum) sums both in one all-reduce of [2, tokens, hidden], not one
    each: the dense MLP's rowwise down projection (no bias: a bias would be added on every rank)
    and the expert block leave their partial sums to the layer's `reduce_branches`."""
    for layer in model.modules():
        dense, block = getattr(layer, "dense_mlp", None), getattr(layer, "mlp", None)
        if not hasattr(layer, "reduce_branches") or dense not in regions or block not in regions:
            continue
        if not isinstance(dense.down_proj, RowwiseLinear) or dense.down_proj.bias is not None:
            continue
        dense.down_proj.group = None  # its partial product, reduced with the experts'
        block.reduce_output = lambda out: out
        layer.reduce_branches = functools.partial(_summed_together, group=group)


def _summed_together(*partials: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    return tuple(comm.from_partial(torch.stack(partials), group).unbind(0))


def _enter_sharded(region: nn.Module, group, tp: int) -> None:
    """Put f where the replicated input of `region` meets its sharded weights, and the MoE block's
    reduce after combine (where `place_reduce` puts it; a rowwise Linear reduces before its bias)."""
    if isinstance(region, MoEBlock):
        region.gate.register_forward_hook(functools.partial(_routing_weights_to_shards, group=group))
        region.dispatcher = TensorParallelDispatcher(region.dispatcher, group)
        region.reduce_output = functools.partial(comm.from_partial, group=group)
        return
    if isinstance(region, (Attention, MLAttention)):
        region.num_heads //= tp
    if isinstance(region, Attention):  # fewer key/value heads than ranks: one copied head each
        region.num_kv_heads = max(region.num_kv_heads // tp, 1)
    region.register_forward_pre_hook(functools.partial(_input_to_shards, group=group))


# ---- checking the plan ----------------------------------------------------------------------------


def _resolve(model: nn.Module, plan: dict[str, str]) -> list[tuple[str, str]]:
    """(module or parameter name, style) for every target of every plan entry."""
    names = [name for name, _ in model.named_modules()] + [name for name, _ in model.named_parameters()]
    targets = []
    for pattern, style in plan.items():
        if style not in _APPLY:
            raise ConfigError(f"TP plan: unknown style {style!r} for {pattern!r}; known: {', '.join(_APPLY)}")
        regex = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise ConfigError(f"TP plan entry {pattern!r} ({style}) matches nothing in the model")
        targets += [(name, style) for name in matched]
    return targets


def _params_of(model: nn.Module, name: str) -> list[nn.Parameter]:
    target = model.get_submodule(name) if name in dict(model.named_modules()) else model.get_parameter(name)
    return list(target.parameters()) if isinstance(target, nn.Module) else [target]


def _check(model: MoECausalLM, targets: list[tuple[str, str]], tp: int, kv_heads: dict[str, int]) -> None:
    covered = {id(p) for name, _ in targets for p in _params_of(model, name)}
    for name, param in model.named_parameters():
        # Vectors (norms, biases) may stay replicated unnoticed; a forgotten matrix may not: it
        # would be silently replicated on every rank. LoRA's factors follow their base.
        if param.dim() >= 2 and id(param) not in covered and not is_adapter(name):
            raise ConfigError(
                f"TP plan covers no entry for {name} {tuple(param.shape)}: shard it or declare it replicated"
            )
    for name, style in targets:
        for param, dim, parts in _splits(model, name, style):
            split = _heads_of(kv_heads, name) or tp  # copied key/value heads: split by head
            if param.shape[dim] % (parts * split):
                raise ConfigError(
                    f"parallel.tp={tp}: {name} ({style}) has {param.shape[dim]} rows on dim {dim}, "
                    f"not divisible into {parts * split}"
                )


def _reduce_at(region: nn.Module, chain: list[Op]) -> int | None:
    at = place_reduce(chain)
    if isinstance(region, MoEBlock) and at not in (None, len(chain)):
        # The block has one place to reduce, after combine.
        raise ConfigError(
            f"TP plan: {chain[at].name} ({chain[at].kind}) would need the MoE block's partial "
            "outputs reduced before it; the block reduces once, after combine"
        )
    return at


def _kv_heads(model: nn.Module, regions: list[nn.Module], tp: int) -> dict[str, int]:
    """The key/value projections (their module names) of the sharded attentions with fewer
    key/value heads than tp ranks, with their head count: each rank keeps a copy of the one head
    its query heads read. ConfigError where tp does not divide the query heads, or neither divides
    nor is a multiple of the key/value heads."""
    paths = {id(module): path for path, module in model.named_modules()}
    fewer = {}
    for attention in regions:
        if not isinstance(attention, (Attention, MLAttention)):
            continue
        if attention.num_heads % tp:
            raise ConfigError(
                f"parallel.tp={tp} must divide the {attention.num_heads} attention heads (layer {attention.layer_idx})"
            )
        heads = getattr(attention, "num_kv_heads", None)  # latent attention has none
        if heads is None or heads % tp == 0:
            continue
        if tp % heads:
            raise ConfigError(
                f"parallel.tp={tp} must divide the {heads} key/value attention heads or be a multiple of "
                f"them (layer {attention.layer_idx})"
            )
        path = paths[id(attention)]
        fewer.update({f"{path}.k_proj": heads, f"{path}.v_proj": heads})
    return fewer


def _heads_of(kv_heads: dict[str, int], name: str) -> int | None:
    """The copied key/value heads of a plan target: a projection, or one of its parameters."""
    return kv_heads.get(name, kv_heads.get(name.rpartition(".")[0]))


def _regions(model: nn.Module, styles: dict[str, str]) -> list[tuple[nn.Module, list[Op]]]:
    """Every attention, dense MLP and MoE block, with the chain of ops the plan makes of it
    (unplanned projections are replicated)."""

    def kind(path: str, *leaves: str) -> str:
        kinds = {styles.get(f"{path}.{leaf}", "replicated") for leaf in leaves}
        if len(kinds) > 1:  # these projections read the same input side by side
            raise ConfigError(f"TP plan: {path}.{'/'.join(leaves)} need one style, got {', '.join(sorted(kinds))}")
        return kinds.pop()

    regions = []
    for path, module in model.named_modules():
        if isinstance(module, Attention):
            # Gemma 4's attention_k_eq_v layers have no v_proj: their values are their keys.
            inputs = ("q_proj", "k_proj", "v_proj") if module.v_proj is not None else ("q_proj", "k_proj")
            chain = [
                Op(f"{path}.{'/'.join(inputs)}", kind(path, *inputs)),
                Op("attention", "local"),
                Op(f"{path}.o_proj", kind(path, "o_proj")),
            ]
            if module.o_proj.bias is not None:
                chain.append(Op(f"{path}.o_proj.bias", "add_replicated"))
        elif isinstance(module, MLAttention):  # the latent projections before are replicated
            queries = "q_proj" if module.q_proj is not None else "q_b_proj"
            chain = [
                Op(f"{path}.{queries}/kv_b_proj", kind(path, queries, "kv_b_proj")),
                Op("attention", "local"),
                Op(f"{path}.o_proj", kind(path, "o_proj")),
            ]
            if module.o_proj.bias is not None:
                chain.append(Op(f"{path}.o_proj.bias", "add_replicated"))
        elif isinstance(module, DenseMLP):
            chain = [
                Op(f"{path}.gate/up_proj", kind(path, "gate_proj", "up_proj")),
                Op("swiglu", "local"),
                Op(f"{path}.down_proj", kind(path, "down_proj")),
            ]
        elif isinstance(module, MoEBlock):
            chain = [
                Op(f"{path}.experts.gate_up_proj", kind(path, "experts.gate_up_proj")),
                Op("swiglu", "local"),
                Op(f"{path}.experts.down_proj", kind(path, "experts.down_proj")),
                Op("routing-weight multiply", "linear"),
                Op("top-k sum", "linear"),
            ]
            if module.experts.gate_up_proj_bias is not None:  # read side by side with its matrix
                chain[0] = Op(chain[0].name, kind(path, "experts.gate_up_proj", "experts.gate_up_proj_bias"))
            if module.experts.down_proj_bias is not None:  # a partial bias is linear, a whole one is not
                bias_kind = "linear" if kind(path, "experts.down_proj_bias") == "partial_bias" else "add_replicated"
                chain.insert(3, Op(f"{path}.experts.down_proj_bias", bias_kind))
            if module.shared_experts is not None:
                # A parallel branch whose output joins the routed experts' before the one reduce:
                # both partial (both sharded) or both whole.
                shared = _shared_chain(f"{path}.shared_experts", kind)
                if (place_reduce(shared) is None) != (place_reduce(chain) is None):
                    raise ConfigError(
                        f"TP plan: {path}.shared_experts and {path}.experts must both be sharded "
                        "or both replicated (their outputs are added before the block's reduce)"
                    )
                chain.append(Op(f"{path}.shared_experts (added)", "linear"))
        else:
            continue
        regions.append((module, chain))
    return regions


def _shared_chain(path: str, kind) -> list[Op]:
    return [
        Op(f"{path}.gate/up_proj", kind(path, "gate_proj", "up_proj")),
        Op("swiglu", "local"),
        Op(f"{path}.down_proj", kind(path, "down_proj")),
    ]


def _splits(model, name, style) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, dim split, parts of that dim each split separately) for one target."""
    if style == "colwise" or style == "vocab":
        return [(p, 0, 1) for p in _params_of(model, name)]
    if style == "rowwise":
        return [(p, -1, 1) for p in _params_of(model, name) if p.dim() >= 2]
    if style == "packed_colwise":  # the bank [E, 2I, H] on its rows, its bias [E, 2I] on its columns
        return [(model.get_parameter(name), packed_dim(name), 2)]
    return []


# ---- sharding -------------------------------------------------------------------------------------


class _Sharder:
    """Cuts this rank's slice of a full parameter, once per parameter, so that tied weights (the
    embedding and the LM head) stay one parameter."""

    def __init__(self, rank: int, tp: int, kv_heads: dict[str, int] | None = None):
        self.rank, self.tp = rank, tp
        self.kv_heads = kv_heads or {}  # `_kv_heads`
        self._done: dict[int, nn.Parameter] = {}

    def __call__(self, param: nn.Parameter, dim: int, parts: int = 1, heads: int | None = None) -> nn.Parameter:
        """This rank's slice: its tp-th of dim (of each of `parts` pieces). With `heads` (fewer
        than tp): the slice of head rank // (tp // heads), the same on tp // heads ranks, which
        the parameter records as `tp_copies`."""
        if id(param) not in self._done:
            chunks, which = (self.tp, self.rank) if heads is None else (heads, self.rank * heads // self.tp)
            pieces = [piece.chunk(chunks, dim)[which] for piece in param.detach().chunk(parts, dim)]
            sharded = nn.Parameter(torch.cat(pieces, dim).clone(), requires_grad=param.requires_grad)
            sharded.tp_dim = dim % param.dim()  # where checkpoints place it in the full tensor
            if heads is not None:
                sharded.tp_copies = self.tp // heads
            rows = [piece.chunk(chunks)[which] for piece in torch.arange(param.shape[dim]).chunk(parts)]
            self._done[id(param)] = record_piece(sharded, param, dim, torch.cat(rows))
        return self._done[id(param)]

    def offset(self, full_size: int) -> int:
        return self.rank * full_size // self.tp


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent, _, leaf = name.rpartition(".")
    return model.get_submodule(parent), leaf


def _colwise(model, name, shard, group):
    parent, leaf = _parent(model, name)
    heads = _heads_of(shard.kv_heads, name)  # copied key/value heads
    if isinstance(getattr(parent, leaf), nn.Parameter):  # per-head values (attention sinks), one parameter
        setattr(parent, leaf, shard(getattr(parent, leaf), 0, heads=heads))
        return
    linear = model.get_submodule(name)
    linear.weight = shard(linear.weight, 0, heads=heads)
    if linear.bias is not None:
        linear.bias = shard(linear.bias, 0, heads=heads)
    if has_adapter(linear):  # B by rows like the weight; A whole, its gradient a partial sum
        linear.lora_B = shard(linear.lora_B, 0, heads=heads)
        linear.lora_A.partial_grad_axis = "tp"


def _rowwise(model, name, shard, group):
    parent, leaf = _parent(model, name)
    target = getattr(parent, leaf)
    if isinstance(target, nn.Parameter):  # an expert bank: reduced by the MoE block
        setattr(parent, leaf, shard(target, -1))
        if leaf in parent.lora_scaling:  # A by columns like the bank; B whole, its gradient a partial sum
            setattr(parent, f"{leaf}_lora_A", shard(getattr(parent, f"{leaf}_lora_A"), -1))
            getattr(parent, f"{leaf}_lora_B").partial_grad_axis = "tp"
        return
    if name.endswith(".shared_experts.down_proj"):  # also reduced by the MoE block, with the routed experts
        target.weight = shard(target.weight, 1)
        rowwise = target
    else:
        rowwise = RowwiseLinear(shard(target.weight, 1), target.bias, group)
        setattr(parent, leaf, rowwise)
    if has_adapter(target):  # A by columns like the weight; B whole, its gradient a partial sum
        rowwise.lora_A, rowwise.lora_B = shard(target.lora_A, 1), target.lora_B
        rowwise.lora_scaling, rowwise.lora_dropout = target.lora_scaling, target.lora_dropout
        rowwise.lora_B.partial_grad_axis = "tp"


def _packed_colwise(model, name, shard, group):
    experts, leaf = _parent(model, name)
    setattr(experts, leaf, shard(getattr(experts, leaf), packed_dim(name), parts=2))
    if leaf in experts.lora_scaling:  # B's rows like the bank's (gate and up slices); A whole, partial gradient
        setattr(experts, f"{leaf}_lora_B", shard(getattr(experts, f"{leaf}_lora_B"), -2, parts=2))
        getattr(experts, f"{leaf}_lora_A").partial_grad_axis = "tp"


def _partial_bias(model, name, shard, group):
    experts, _ = _parent(model, name)
    experts.down_bias_share = 1.0 / shard.tp
    model.get_parameter(name).partial_grad_axis = "tp"


def _vocab(model, name, shard, group):
    parent, leaf = _parent(model, name)
    module = getattr(parent, leaf)
    start = shard.offset(module.weight.shape[0])
    if isinstance(module, nn.Embedding):
        setattr(parent, leaf, VocabParallelEmbedding(shard(module.weight, 0), start, group))
    else:  # the LM head: each rank computes the logits of its vocabulary slice
        module.weight = shard(module.weight, 0)
        module.register_forward_pre_hook(functools.partial(_input_to_shards, group=group))
        model.vocab_parallel_loss = functools.partial(vocab_parallel_cross_entropy, vocab_start=start, group=group)
        model.vocab_parallel_logprobs = functools.partial(vocab_parallel_logprobs, vocab_start=start, group=group)
        model.gather_logits = functools.partial(comm.all_gather, group=group, dim=-1)


def _replicated_with_grad_allreduce(model, name, shard, group):
    for param in _params_of(model, name):
        # A tag, not a gradient hook: it survives FSDP replacing the parameter, and the sum is
        # taken once per step rather than once per micro-batch.
        param.partial_grad_axis = "tp"


_APPLY = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "packed_colwise": _packed_colwise,
    "partial_bias": _partial_bias,
    "vocab": _vocab,
    "replicated": lambda *args: None,
    "replicated_with_grad_allreduce": _replicated_with_grad_allreduce,
}


# ---- sharded modules and region boundaries --------------------------------------------------------


class RowwiseLinear(nn.Module):
    """y = Σ_ranks x_r W_r^T + b: the partial products are all-reduced (g), then the bias is
    added once. With LoRA (lora_A split by columns, lora_B whole) each rank adds its partial
    s · x_r A_r^T B^T before the same one all-reduce."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group):
        super().__init__()
        self.weight, self.bias, self.group = weight, bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = adapted_linear(self, x) if has_adapter(self) else linear(x, self.weight)
        out = comm.from_partial(out, self.group)
        return out if self.bias is None else summed_norm.settled(out) + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + rows) of the embedding: tokens outside the slice look up
    zeros, and the all-reduce (g) gives every rank the full embedding."""

    def __init__(self, weight: nn.Parameter, vocab_start: int, group):
        super().__init__()
        self.weight, self.vocab_start, self.group = weight, vocab_start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        here = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(here, local, 0), self.weight)
        return comm.from_partial(torch.where(here[..., None], rows, 0.0), self.group)


class TensorParallelDispatcher:
    """Wraps a block's dispatcher: the tokens enter the experts' sharded compute through f."""

    def __init__(self, inner, group):
        self.inner, self.group = inner, group
        self.local = inner.local

    def dispatch(self, x, routing, num_experts):
        return self.inner.dispatch(comm.to_shards(x, self.group), routing, num_experts)

    def combine(self, expert_out, dispatched, routing, num_tokens):
        return self.inner.combine(expert_out, dispatched, routing, num_tokens)


def _input_to_shards(module, args, group):
    return (comm.to_shards(args[0], group), *args[1:])


def _routing_weights_to_shards(router, args, routing, group):
    return dataclasses.replace(routing, weights=comm.to_shards(routing.weights, group))


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, group, ignore_index: int = -100
) -> torch.Tensor:
    """`next_token_loss` of logits split by vocabulary ([..., V/tp], this rank's columns from
    vocab_start), without gathering them: the max, then the sum of exponentials and the target
    logit (one all-reduce for both) are reduced over the group."""
    targets = shift_labels(labels, ignore_index).flatten()
    valid = targets != ignore_index
    total = torch.where(valid, -vocab_parallel_logprobs(logits.flatten(0, -2), targets, vocab_start, group), 0.0).sum()
    return total / valid.sum().clamp_min(1)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int, group) -> torch.Tensor:
    """log softmax(logits)[target] per row of logits split by vocabulary ([N, V/tp], this rank's
    columns from vocab_start; targets [N], whole vocabulary ids), in fp32, differentiable, without
    gathering them: the max, then the sum of exponentials and the target logit (one all-reduce for
    both) are reduced over the group. A target outside [0, V) gives -log Σ exp."""
    logits = logits.float()
    shift = comm.all_reduce_max(logits.max(dim=-1).values, group)  # constant: it cancels
    shifted = logits - shift[:, None]
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    target = torch.where(here, shifted.gather(1, local.clamp(0, logits.shape[-1] - 1)[:, None]).squeeze(1), 0.0)
    sum_exp, target = comm.from_partial(torch.stack([shifted.exp().sum(-1), target]), group)
    return target - sum_exp.log()
