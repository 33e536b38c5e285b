"""Where a tensor-parallel value lives, and where a region's one all-reduce must go.

    Replicated   every rank holds the whole tensor
    Sharded(d)   each rank holds a slice along dim d
    Partial      each rank holds a summand; the value is the sum over the ranks

A region is a chain of ops from a replicated input to a replicated output. `place_reduce`
propagates placements along it and puts the all-reduce as late as possible: an op linear in its
Partial input (multiplying by replicated routing weights or scales, views, the top-k sum,
adding another Partial) consumes it, and the first op that is not (a nonlinearity, adding a
replicated bias or the residual) forces the reduce before it. A chain whose ops cannot take the
placement they receive (a row-parallel matmul fed a replicated input, a sharded value leaving the
region) is a wrong plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.errors import ConfigError


@dataclass(frozen=True)
class Replicated:
    pass


@dataclass(frozen=True)
class Sharded:
    dim: int = -1


@dataclass(frozen=True)
class Partial:
    pass


Placement = Replicated | Sharded | Partial


def _only(accepts: Placement, gives: Placement):
    return lambda p: gives if p == accepts else None


# Each kind of op: input placement -> output placement, or None where it cannot take that input.
RULES = {
    "colwise": _only(Replicated(), Sharded()),  # a matmul split on its output features
    "packed_colwise": _only(Replicated(), Sharded()),
    "rowwise": _only(Sharded(), Partial()),  # split on its input features: partial sums
    "replicated": _only(Replicated(), Replicated()),  # a whole-weight op on the whole input
    "local": lambda p: None if p == Partial() else p,  # nonlinear but slice by slice (SwiGLU, per-head attention)
    "linear": lambda p: p,  # linear in this input: consumes a Partial
    "add_replicated": _only(Replicated(), Replicated()),  # a bias or the residual: a Partial would get it tp times
}


@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # a key of RULES


def place_reduce(ops: list[Op]) -> int | None:
    """Index of the op before which the region's all-reduce goes (len(ops): after the last op;
    None: the region needs none). Raises ConfigError if the chain does not fit together."""
    placement, reduce_at = Replicated(), None
    for i, op in enumerate(ops):
        rule = RULES.get(op.kind, lambda p: None)
        out = rule(placement)
        if out is None and placement == Partial() and reduce_at is None:
            placement, reduce_at = Replicated(), i
            out = rule(placement)
        if out is None:
            raise ConfigError(f"TP plan: {op.name} ({op.kind}) cannot take a {placement} input")
        placement = out
    if placement == Partial() and reduce_at is None:
        return len(ops)
    if placement != Replicated():
        raise ConfigError(f"TP plan: the region ending in {ops[-1].name} leaves its output {placement}")
    return reduce_at
