"""Pipeline schedules as pure logic: coverage, dependencies, message order, bubble and memory."""

import pytest

from moemesh.errors import ConfigError
from moemesh.parallel.pipeline.schedule import (
    Op,
    Schedule,
    build_schedule,
    dualpipev,
    messages,
    min_micro_batches,
    one_f_one_b,
    paired,
    parts,
    peak_in_flight,
    run_schedule,
    simulate,
)


def _cases(name: str, ranks=(1, 2, 3, 4)) -> list[tuple[str, int, int]]:
    cases = []
    for p in ranks:
        low = min_micro_batches(name, p)
        for n in sorted({low, low + 1, 2 * low, 2 * low + 3}):
            cases.append((name, p, n))
    return cases


CASES = _cases("1f1b") + _cases("dualpipev")


@pytest.mark.parametrize("name,p,n", CASES)
def test_every_forward_and_backward_once_on_its_rank(name, p, n):
    s = build_schedule(name, p, n)
    assert s.num_stages == (2 * p if name == "dualpipev" else p)
    seen = []
    for rank, ops in enumerate(s.ops):
        queued = 0
        for op in ops:
            for kind, stage, micro in parts(op):
                assert s.stage_rank[stage] == rank
                seen.append((kind, stage, micro))
            if op.kind == "W":
                queued -= 1
                assert queued >= 0, "a W ran before the deferred backward it belongs to"
            elif op.defer_weight:
                queued += 1
        assert queued == 0, "every deferred backward gets its W on the same rank"
    expected = [(k, st, m) for k in "FB" for st in range(s.num_stages) for m in range(n)]
    assert sorted(seen) == sorted(expected)


@pytest.mark.parametrize("name,p,n", CASES)
def test_simulate_respects_dependencies(name, p, n):
    s = build_schedule(name, p, n)
    t = simulate(s, f=3, b=5, w=2, fb=9)
    last = s.num_stages - 1
    done = {}
    for rank, ops in enumerate(s.ops):
        for op, end in zip(ops, t.end[rank]):
            for part in parts(op):
                done[part] = end
    for rank, ops in enumerate(s.ops):
        assert all(e0 <= s1 for e0, s1 in zip(t.end[rank], t.start[rank][1:])), "ops of a rank overlap"
        for op, start in zip(ops, t.start[rank]):
            for kind, stage, micro in parts(op):
                if kind == "F" and stage > 0:
                    assert start >= done["F", stage - 1, micro]
                if kind == "B":
                    assert start >= done["F", stage, micro]
                    if stage < last:
                        assert start >= done["B", stage + 1, micro]
    assert t.makespan == max(max(e) for e in t.end)


def test_simulate_raises_on_deadlock():
    # Rank 0 waits for the gradient of micro 1 before forwarding micro 1 itself.
    ops = (
        (Op("F", 0, 0), Op("B", 0, 1), Op("F", 0, 1), Op("B", 0, 0)),
        (Op("F", 1, 0), Op("B", 1, 0), Op("F", 1, 1), Op("B", 1, 1)),
    )
    s = Schedule("1f1b", 2, 2, 2, (0, 1), ops)
    with pytest.raises(ValueError, match="deadlock"):
        simulate(s, 1, 1, 1)


def _with_dualpipev_prefetch(s: Schedule) -> dict:
    """The reference (DualPipeV.step, step 2) posts the receive of the activation for the first
    forward of its main step (micro 2P-1-r on rank r) before step 3, whose backwards receive
    gradients from the same neighbour. On ranks 1..P-2, which have a step 3, that receive
    therefore comes before those gradients, not where its op needs it."""
    p = s.num_ranks
    out = {}
    for (src, dst), (sent, received) in messages(s).items():
        received = list(received)
        if dst == src + 1 and 1 <= dst <= p - 2:
            early = ("act", src, 2 * p - 1 - dst)
            received.remove(early)
            received.insert(next(i for i, m in enumerate(received) if m[0] == "grad"), early)
        out[src, dst] = (sent, received)
    return out


@pytest.mark.parametrize("name,p,n", CASES + _cases("dualpipev", ranks=(5, 8)))
def test_messages_match_in_order(name, p, n):
    s = build_schedule(name, p, n)
    pairs = messages(s)
    for (src, dst), (sent, received) in pairs.items():
        assert src != dst and abs(src - dst) == 1
        assert sorted(sent) == sorted(received)
    if name == "1f1b" or p <= 2:
        assert all(sent == received for sent, received in pairs.values())
    else:
        # In op order the faithful DualPipeV does not match for P >= 3; with the reference's one
        # early receive per rank it does, so a runtime must post that receive early as well.
        assert any(sent != received for sent, received in pairs.values())
        assert all(sent == received for sent, received in _with_dualpipev_prefetch(s).values())
    # Each stage boundary between two ranks carries one activation and one gradient per micro.
    crossings = sum(s.stage_rank[st] != s.stage_rank[st + 1] for st in range(s.num_stages - 1))
    assert sum(len(sent) for sent, _ in pairs.values()) == 2 * n * crossings


def test_messages_skip_local_hand_off():
    # One rank holds both stages: nothing leaves it.
    assert messages(dualpipev(1, 2)) == {}
    # The turn of the V (stages P-1 and P on the last rank) is local too.
    sent = [m for s, _ in messages(dualpipev(2, 4)).values() for m in s]
    assert ("act", 1, 0) not in sent and ("grad", 2, 0) not in sent


@pytest.mark.parametrize("name,p,n", _cases("1f1b"))
def test_one_f_one_b_bubble(name, p, n):
    # 1F1B's bubble (PP-1)(F+B), from the DualPipe README table; B is a full backward: b + w.
    t = simulate(one_f_one_b(p, n), f=3, b=5, w=2)
    assert t.bubble == pytest.approx([(p - 1) * (3 + 5 + 2)] * p)


@pytest.mark.parametrize("name,p,n", _cases("dualpipev"))
@pytest.mark.parametrize("f,b,w", [(3, 3, 2), (5, 5, 1), (1, 1, 1)])
def test_dualpipev_bubble(name, p, n, f, b, w):
    # deepseek-ai/DualPipe README: DualPipeV bubble (PP/2-1)(F&B+B-3W), PP = pipeline stages = 2P,
    # F&B = an overlapped forward+backward pair, B = a full backward, W = its weight part.
    # It holds exactly, on every rank, under the reference figure's cost assumptions only: a
    # forward costs as much as a backward's input part (f == b here), W <= F, and F&B = F + B
    # (overlap saves no time). With other costs the measured bubble differs (ranks then also
    # differ in busy time, as they run different numbers of overlapped pairs).
    # E.g. (3, 3, 2): F=3, B=5, W=2, F&B=8 are distinct.
    full_b = b + w
    t = simulate(dualpipev(p, n), f=f, b=b, w=w, fb=f + full_b)
    assert t.bubble == pytest.approx([(p - 1) * ((f + full_b) + full_b - 3 * w)] * p)
    # fb defaults to f + b + w for a non-deferred backward: the same timeline.
    assert simulate(dualpipev(p, n), f=f, b=b, w=w) == t


@pytest.mark.parametrize("name,p,n", _cases("1f1b"))
def test_one_f_one_b_peak_in_flight(name, p, n):
    assert peak_in_flight(one_f_one_b(p, n)) == [min(p - s, n) for s in range(p)]


@pytest.mark.parametrize("name,p,n", _cases("dualpipev"))
def test_dualpipev_peak_in_flight(name, p, n):
    # Hand-derived for P=2 (stages 0,3 on rank 0; 1,2 on rank 1) from the reference's steps:
    # rank 0 forwards micros 0-2 on stage 0 (steps 1-2) and micro 3 in its first overlapped pair
    # before stage 0's first backward: 4. Rank 1 forwards micros 0-2 on stage 1 before its first
    # backward (in the pair after the split first pair): 3; stage 2 holds micros 0,1, then 1,2: 2;
    # stage 3 (the loss) backwards each micro right after its forward: 1. So [4, 3, 2, 1], i.e.
    # 2P - s; a rank's two stages add to 2P + 1, the README's "PP+1" activations per device.
    assert peak_in_flight(dualpipev(p, n)) == [2 * p - s for s in range(2 * p)]


def _compact(ops) -> str:
    def one(op: Op) -> str:
        if op.kind == "W":
            return "W"
        if op.kind == "FB":
            return f"F{op.stage}.{op.micro}&B{op.b_stage}.{op.b_micro}"
        return f"{op.kind}{op.stage}.{op.micro}{'*' if op.defer_weight else ''}"

    return " ".join(map(one, ops))


def test_dualpipev_two_ranks_by_hand():
    # Traced by hand through DualPipeV.step() for 2 ranks and 4 micro-batches; * = deferred weight.
    s = dualpipev(2, 4)
    assert s.stage_rank == (0, 1, 1, 0)
    assert _compact(s.ops[0]) == (
        "F0.0 F0.1 "  # step 1
        "F0.2 F3.0 "  # step 2
        "B3.0* W F3.1 "  # step 3
        "F0.3&B3.1 F3.2&B0.0 "  # step 4
        "B3.2 F3.3&B0.1 "  # step 5
        "B3.3 B0.2* "  # step 6
        "W B0.3* "  # step 7
        "W"  # step 8
    )
    assert _compact(s.ops[1]) == (
        "F1.0 F2.0 F1.1 F2.1 "  # step 2
        "F1.2 B2.0 F2.2&B1.0 F1.3&B2.1 F2.3&B1.1 "  # step 4, its first pair split
        "B2.2 B1.2 B2.3* B1.3* "  # step 6
        "W W"  # step 8
    )


def test_too_few_micro_batches():
    with pytest.raises(ConfigError) as e:
        dualpipev(2, 3)
    assert str(e.value) == (
        "dualpipev with pp=2 needs at least 4 micro-batches (train.global_batch / train.micro_batch), got 3"
    )
    with pytest.raises(ConfigError, match="1f1b with pp=4 needs at least 4 micro-batches .* got 3"):
        build_schedule("1f1b", 4, 3)
    with pytest.raises(ConfigError, match="pp >= 1"):
        one_f_one_b(0, 4)


def test_unknown_schedule():
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'gpipe'; known: dualpipev, 1f1b"):
        build_schedule("gpipe", 2, 8)
    with pytest.raises(ConfigError, match="known: dualpipev, 1f1b"):
        min_micro_batches("zb", 2)


def test_simulate_with_uneven_stage_times():
    """A stage twice as slow as the others sets the pace: 1F1B over 2 ranks with stage times
    (1, 2) keeps rank 1 always busy after its first forward and leaves rank 0 waiting, where equal
    times give both ranks the same bubble."""
    schedule = build_schedule("1f1b", 2, 8)
    even = simulate(schedule, 1.0, 1.0, 1.0)
    uneven = simulate(schedule, 1.0, 1.0, 1.0, stage_time=[1.0, 2.0])
    assert even.bubble[0] == pytest.approx(even.bubble[1])
    assert uneven.makespan > even.makespan and uneven.bubble[0] > uneven.bubble[1]
    assert uneven.busy == (pytest.approx(8 * 3.0), pytest.approx(8 * 6.0))  # F + B + W per micro-batch, scaled


def test_paired_overlaps_each_forward_with_the_previous_backward_on_one_rank():
    """Without a pipeline, under EP with parallel.pp_overlap: F0, (F1, B0), (F2, B1), ..., B3 —
    every forward and backward once, two micro-batches in flight; otherwise no schedule, but for
    a step captured whole as a CUDA graph."""
    s = run_schedule(pp=1, name="dualpipev", overlap=True, ep=2, dp_shard=1, num_micro=4)
    assert s.name == "paired" and s.num_ranks == 1 and s.num_stages == 1
    assert s.ops[0] == (Op("F", 0, 0), Op("FB", 0, 1, 0, 0), Op("FB", 0, 2, 0, 1), Op("FB", 0, 3, 0, 2), Op("B", 0, 3))
    assert peak_in_flight(s) == [2]
    assert simulate(s, 1.0, 2.0, 0.0).makespan == 12.0  # nothing waits on one rank
    for overlap, ep, dp_shard, n in ((False, 2, 1, 4), (True, 1, 1, 4), (True, 2, 2, 4), (True, 2, 1, 1)):
        assert run_schedule(1, "dualpipev", overlap, ep, dp_shard, n) is None
    assert run_schedule(2, "1f1b", True, 2, 1, 4).name == "1f1b"
    # A step captured as one CUDA graph under EP goes through one rank's 1F1B when it pairs nothing.
    assert run_schedule(1, "dualpipev", False, 2, 1, 4, whole_step=True).name == "1f1b"
    assert run_schedule(1, "dualpipev", True, 2, 1, 1, whole_step=True).name == "1f1b"
    assert run_schedule(1, "dualpipev", False, 1, 1, 4, whole_step=True) is None  # one process: per micro-batch
    with pytest.raises(ConfigError, match="at least 2 micro-batches"):
        paired(1)
