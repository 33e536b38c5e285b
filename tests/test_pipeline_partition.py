"""Pipeline stage partition: exact (checked against brute force), contiguous, better than an even
split on memory while keeping every stage within the time bound."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from moemesh.errors import ConfigError
from moemesh.parallel.pipeline.partition import (
    LayerCost,
    describe,
    partition,
    rank_memory,
)


def _random_costs(rng: random.Random, n: int) -> list[LayerCost]:
    return [LayerCost(f"item {i}", rng.uniform(0, 10), rng.uniform(0, 10), rng.uniform(0.1, 10)) for i in range(n)]


def _times(costs, ranges) -> list[float]:
    return [sum(costs[i].time for i in items) for items in ranges]


def _all_partitions(n: int, num_stages: int):
    for cuts in itertools.combinations(range(1, n), num_stages - 1):
        bounds = (0, *cuts, n)
        yield [range(a, b) for a, b in itertools.pairwise(bounds)]


def _check_ranges(ranges: list[range], n: int, num_stages: int) -> None:
    assert len(ranges) == num_stages
    assert all(len(items) > 0 for items in ranges)
    assert [i for items in ranges for i in items] == list(range(n))  # contiguous, in order, all


def _layouts(rng: random.Random, num_stages: int) -> list[int]:
    """1F1B (one stage per rank), DualPipeV-like (rank r holds stages r and S-1-r), or random."""
    kind = rng.choice(["1f1b", "v", "random"])
    if kind == "1f1b":
        return list(range(num_stages))
    if kind == "v":
        return [min(s, num_stages - 1 - s) for s in range(num_stages)]
    return [rng.randrange(max(1, num_stages - 1)) for _ in range(num_stages)]


def test_exact_against_brute_force():
    rng = random.Random(torch.randint(2**31, ()).item())  # fresh each run, reproducible from the test name
    for _ in range(40):
        n = rng.randint(2, 9)
        num_stages = rng.randint(1, min(n, 5))
        costs = _random_costs(rng, n)
        stage_rank = _layouts(rng, num_stages)
        in_flight = [rng.randint(1, 5) for _ in range(num_stages)]
        slack = rng.choice([0.0, 0.1, 0.5])

        ranges = partition(costs, num_stages, in_flight, stage_rank, time_slack=slack)
        _check_ranges(ranges, n, num_stages)

        candidates = list(_all_partitions(n, num_stages))
        best_time = min(max(_times(costs, r)) for r in candidates)
        feasible = [r for r in candidates if max(_times(costs, r)) <= (1 + slack) * best_time * (1 + 1e-12)]
        best = min((max(rank_memory(costs, r, in_flight, stage_rank)), max(_times(costs, r))) for r in feasible)
        got = (max(rank_memory(costs, ranges, in_flight, stage_rank)), max(_times(costs, ranges)))
        assert max(_times(costs, ranges)) <= (1 + slack) * best_time * (1 + 1e-9)
        assert got == pytest.approx(best, rel=1e-12)


def _model_costs() -> list[LayerCost]:
    """A big embedding and head, two cheap dense layers, then heavy MoE layers (noisy sizes)."""

    def noise():
        return 1 + 0.05 * torch.rand(()).item()

    costs = [LayerCost("embedding", 800 * noise(), 1 * noise(), 0.1)]
    costs += [LayerCost(f"layer {i}", 20 * noise(), 30 * noise(), 2 * noise()) for i in range(2)]
    costs += [LayerCost(f"layer {i}", 200 * noise(), 40 * noise(), 3 * noise()) for i in range(2, 10)]
    return costs + [LayerCost("head", 800 * noise(), 60 * noise(), 4 * noise())]


@pytest.mark.parametrize("stage_rank", [[0, 1, 2, 3], [0, 1, 1, 0]], ids=["1f1b", "dualpipev"])
def test_uneven_layers_beat_even_split(stage_rank):
    costs, num_stages = _model_costs(), 4
    in_flight = [4, 3, 2, 1]
    ranges = partition(costs, num_stages, in_flight, stage_rank, time_slack=0.5)
    _check_ranges(ranges, len(costs), num_stages)
    assert ranges[0][0] == 0 and ranges[-1][-1] == len(costs) - 1  # embedding first stage, head last

    best_time = min(max(_times(costs, r)) for r in _all_partitions(len(costs), num_stages))
    assert max(_times(costs, ranges)) <= 1.5 * best_time * (1 + 1e-9)
    size, extra = divmod(len(costs), num_stages)
    bounds = [0, *itertools.accumulate(size + (s < extra) for s in range(num_stages))]
    even = [range(a, b) for a, b in itertools.pairwise(bounds)]
    assert max(_times(costs, even)) <= 1.5 * best_time  # the even split is a fair competitor here
    peak = max(rank_memory(costs, ranges, in_flight, stage_rank))
    assert peak < max(rank_memory(costs, even, in_flight, stage_rank))

    rows = describe(costs, ranges, in_flight, stage_rank)
    assert [row["items"] for row in rows] == ranges
    assert rows[0]["layers"].startswith("embedding") and rows[-1]["layers"].endswith("head")
    by_rank = {}
    for row in rows:
        by_rank[row["rank"]] = by_rank.get(row["rank"], 0) + row["memory"]
    assert max(by_rank.values()) == pytest.approx(peak)


def test_fewer_items_than_stages():
    costs = _random_costs(random.Random(0), 3)
    with pytest.raises(ConfigError, match=r"cannot split 3 layers .* into 4 non-empty pipeline stages"):
        partition(costs, 4, [1] * 4, list(range(4)))
