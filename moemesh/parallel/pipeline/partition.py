"""Cut the model's items (embedding, decoder layers, head) into contiguous pipeline stages.

Cost model. Each item has a parameter footprint (weights, gradients and optimizer state a rank
keeps), the activations one micro-batch saves for its backward, and a forward + backward time.
At its peak, stage s holds the activations of `in_flight[s]` micro-batches (the schedule decides
how many) and, unless it ends with the head, their outputs (those of its last item), plus while an
item runs its working memory (the fused cross-entropy's fp32 weight-gradient buffer, for one), so
its memory is

    params(stage) + in_flight[s] * (activations(stage) + output(last item)) + max working(item),

and a rank's memory is the sum over the stages it runs (`stage_rank[s] == rank`; DualPipeV gives
each rank two stages, 1F1B one).

Objective. The pipeline's speed is set by its slowest stage, so first find the smallest achievable
maximum stage time T*; then, among the partitions whose every stage takes at most
(1 + time_slack) * T*, take one of least peak rank memory (ties: least maximum stage time).

Search. T* comes from the classic min-max dynamic programme over cut points. The memory search
is a dynamic programme over (stage, end of stage) whose labels are Pareto-optimal triples
(memory of the ranks still to receive another stage, peak of the finished ranks, maximum stage
time). A label is dropped when another one at the same state is no worse in every coordinate,
which keeps the search exact; with one stage per rank there are no open ranks and it is a plain
DP. With DualPipeV's pairs the front grows with the ranks left open — past a hundred thousand
labels for DeepSeek-V3's 63 items in 16 stages — so each state keeps at most MAX_LABELS, those of
least peak memory so far: exact wherever the front stays that small (every partition the tests
check against brute force), a beam search beyond.
"""

from __future__ import annotations

from dataclasses import dataclass

from moemesh.errors import ConfigError

MAX_LABELS = 32  # Pareto labels kept per search state (see the module docstring)


@dataclass(frozen=True)
class LayerCost:
    name: str  # "embedding", "layer 0", ..., "head" (final norm + LM head + loss)
    param_bytes: float  # weights + gradients + optimizer state this rank keeps for it
    activation_bytes: float  # saved for backward per micro-batch
    time: float  # forward + backward time (any unit)
    output_bytes: float = 0.0  # its output, kept per micro-batch in flight by a stage that ends with it
    working_bytes: float = 0.0  # needed only while it runs (once per stage, not per micro-batch)


@dataclass(frozen=True)
class _Label:
    open: tuple[float, ...]  # memory so far of each rank that gets another stage later
    closed: float  # peak memory of the ranks that have all their stages
    max_time: float
    start: int  # first item of the last stage
    parent: _Label | None


def partition(
    costs: list[LayerCost], num_stages: int, in_flight: list[int], stage_rank: list[int], time_slack: float = 0.1
) -> list[range]:
    """Contiguous, non-empty item ranges, one per stage, covering `costs` in order."""
    n = len(costs)
    _check(n, num_stages, in_flight, stage_rank)
    tables = _StageTables(costs)
    # A hair of relative slack so that the optimum itself never fails its own bound by rounding.
    time_bound = (1 + time_slack) * min_max_stage_time(tables, n, num_stages) * (1 + 1e-12)

    later = [set(stage_rank[s + 1 :]) for s in range(num_stages)]
    open_ranks = [sorted(set(stage_rank[: s + 1]) & later[s]) for s in range(num_stages)]
    labels: dict[int, list[_Label]] = {0: [_Label((), 0.0, 0.0, 0, None)]}  # by end of the last stage
    for s in range(num_stages):
        rank, previous_open = stage_rank[s], open_ranks[s - 1] if s else []
        new: dict[int, list[_Label]] = {}
        for i, bucket in labels.items():
            # Stage s is items [i, j): non-empty, leaving at least one item per later stage.
            for j in range(i + 1, n - (num_stages - 1 - s) + 1):
                time = tables.time[i][j]
                if time > time_bound:
                    break  # times are non-negative: longer stages only take longer
                memory = tables.params[i][j] + in_flight[s] * tables.activations[i][j] + tables.working[i][j]
                for label in bucket:
                    held = dict(zip(previous_open, label.open))
                    held[rank] = held.get(rank, 0.0) + memory
                    closed = max([label.closed] + [v for r, v in held.items() if r not in later[s]])
                    candidate = _Label(
                        tuple(held[r] for r in open_ranks[s]), closed, max(label.max_time, time), i, label
                    )
                    _add_pareto(new.setdefault(j, []), candidate)
        for bucket in new.values():
            if len(bucket) > MAX_LABELS:  # keep the least peak memory so far, then the least time
                bucket.sort(key=lambda label: (max((*label.open, label.closed)), label.max_time))
                del bucket[MAX_LABELS:]
        labels = new

    best = min(labels[n], key=lambda label: (label.closed, label.max_time))
    ranges, end, label = [], n, best
    while label.parent is not None:
        ranges.append(range(label.start, end))
        end, label = label.start, label.parent
    return ranges[::-1]


def min_max_stage_time(tables: _StageTables, n: int, num_stages: int) -> float:
    """The least achievable maximum stage time over all partitions into num_stages ranges."""
    inf = float("inf")
    best = [0.0] + [inf] * n  # best[j]: first j items in s + 1 stages
    for s in range(num_stages):
        best = [inf] * (s + 1) + [
            min(max(best[i], tables.time[i][j]) for i in range(s, j)) for j in range(s + 1, n + 1)
        ]
    return best[n]


def rank_memory(
    costs: list[LayerCost], ranges: list[range], in_flight: list[int], stage_rank: list[int]
) -> list[float]:
    """Per rank (0 .. max rank): parameters + in-flight activations of the stages it holds."""
    memory = [0.0] * (max(stage_rank) + 1)
    for s, items in enumerate(ranges):
        memory[stage_rank[s]] += _stage_memory(costs, items, in_flight[s])
    return memory


def describe(costs: list[LayerCost], ranges: list[range], in_flight: list[int], stage_rank: list[int]) -> list[dict]:
    """One row per stage, for printing."""
    rows = []
    for s, items in enumerate(ranges):
        names = [costs[i].name for i in items]
        rows.append(
            {
                "stage": s,
                "rank": stage_rank[s],
                "layers": names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}",
                "items": items,
                "params": _sum(costs, items, "param_bytes"),
                "activations": _sum(costs, items, "activation_bytes"),
                "in_flight": in_flight[s],
                "time": _sum(costs, items, "time"),
                "memory": _stage_memory(costs, items, in_flight[s]),
            }
        )
    return rows


def _stage_memory(costs: list[LayerCost], items: range, in_flight: int) -> float:
    return (
        _sum(costs, items, "param_bytes")
        + in_flight * (_sum(costs, items, "activation_bytes") + _kept_output(costs, items.stop))
        + max(costs[i].working_bytes for i in items)
    )


def _kept_output(costs: list[LayerCost], end: int) -> float:
    """What a stage ending before item `end` keeps per micro-batch beside its saved tensors: its
    output, until its backward (the last stage's is the loss)."""
    return costs[end - 1].output_bytes if end < len(costs) else 0.0


def _sum(costs: list[LayerCost], items: range, field: str) -> float:
    return sum(getattr(costs[i], field) for i in items)


class _StageTables:
    """params / activations (with the kept output) / time of items [i, j), for every i < j,
    summed in item order (the same floats as `_stage_memory`, so that the search and
    `rank_memory` agree exactly)."""

    def __init__(self, costs: list[LayerCost]):
        n = len(costs)
        self.params, self.activations, self.time, self.working = (
            [[0.0] * (n + 1) for _ in range(n + 1)] for _ in range(4)
        )
        for i in range(n):
            p = a = t = w = 0
            for j in range(i, n):
                p, a, t = p + costs[j].param_bytes, a + costs[j].activation_bytes, t + costs[j].time
                w = max(w, costs[j].working_bytes)
                self.params[i][j + 1], self.activations[i][j + 1], self.time[i][j + 1], self.working[i][j + 1] = (
                    p,
                    a + _kept_output(costs, j + 1),
                    t,
                    w,
                )


def _add_pareto(labels: list[_Label], candidate: _Label) -> None:
    """Insert unless some label is no worse everywhere; drop the labels it beats."""

    def no_worse(a: _Label, b: _Label) -> bool:
        return a.closed <= b.closed and a.max_time <= b.max_time and all(x <= y for x, y in zip(a.open, b.open))

    if any(no_worse(label, candidate) for label in labels):
        return
    labels[:] = [label for label in labels if not no_worse(candidate, label)]
    labels.append(candidate)


def _check(n: int, num_stages: int, in_flight: list[int], stage_rank: list[int]) -> None:
    if num_stages < 1:
        raise ConfigError(f"need at least one pipeline stage, got {num_stages}")
    if n < num_stages:
        raise ConfigError(
            f"cannot split {n} layers (embedding, decoder layers and head) into {num_stages} non-empty pipeline stages"
        )
    if len(in_flight) != num_stages or len(stage_rank) != num_stages:
        raise ConfigError(
            f"in_flight ({len(in_flight)}) and stage_rank ({len(stage_rank)}) need one entry per stage ({num_stages})"
        )
