"""Pipeline schedules as pure logic: which operation each pipeline rank runs, in which order.

The model: a network is cut into `num_stages` consecutive stages; `stage_rank[s]` is the rank that
holds stage s. A batch is split into `num_micro` micro-batches. Each (stage, micro) pair needs one
forward ("F") and one backward ("B"). A rank runs its `ops` strictly in order, one at a time:

- "F": forward of one micro-batch on one stage; its output goes to stage s+1 ("act" message).
- "B": backward; needs the forward of that (stage, micro) and the gradient from stage s+1; its
  input gradient goes to stage s-1 ("grad" message). With `defer_weight` it computes only the
  input gradient and queues the weight gradient on the rank.
- "W": runs the oldest queued weight gradient of the rank (one FIFO queue per rank, as
  DeepSeek's WeightGradStore), so weight gradients can fill what would otherwise be bubbles.
- "FB": a forward and a backward of different stages run together, so that one's compute hides
  the other's communication (DualPipe's overlapped chunks).

Messages are implied by the ops: a rank receives an op's inputs just before it and sends its
outputs just after it (`messages` says where DualPipeV must receive earlier). Stages held by
the same rank hand off locally. `messages`, `peak_in_flight` and `simulate` derive the
traffic, the activation memory and the timing from the op lists alone, so schedules can be
checked without processes.
"""

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from moemesh.errors import ConfigError


@dataclass(frozen=True)
class Op:
    kind: str  # "F", "B", "W" or "FB"
    stage: int = -1  # F, B: the stage; FB: the forward's stage; W: -1
    micro: int = -1  # F, B: the micro-batch; FB: the forward's micro-batch; W: -1
    b_stage: int = -1  # FB only: the backward's stage
    b_micro: int = -1  # FB only: the backward's micro-batch
    defer_weight: bool = False  # B and FB's backward: queue the weight gradient for a later W


@dataclass(frozen=True)
class Schedule:
    name: str
    num_ranks: int
    num_micro: int
    num_stages: int
    stage_rank: tuple[int, ...]
    ops: tuple[tuple[Op, ...], ...]  # per rank, in execution order


def parts(op: Op) -> list[tuple[str, int, int]]:
    """The forward and backward work of an op as ("F" | "B", stage, micro), in the op's order."""
    if op.kind == "F" or op.kind == "B":
        return [(op.kind, op.stage, op.micro)]
    if op.kind == "FB":
        return [("F", op.stage, op.micro), ("B", op.b_stage, op.b_micro)]
    return []


# ---- building ------------------------------------------------------------------------------------


def min_micro_batches(name: str, num_ranks: int) -> int:
    """The fewest micro-batches schedule `name` accepts on `num_ranks` ranks."""
    if name == "dualpipev":
        return 2 * num_ranks  # the reference asserts num_chunks >= num_ranks * 2
    if name == "1f1b":
        return num_ranks
    raise ConfigError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")


def _check(name: str, num_ranks: int, num_micro: int) -> None:
    if num_ranks < 1:
        raise ConfigError(f"{name} needs pp >= 1, got {num_ranks}")
    need = min_micro_batches(name, num_ranks)
    if num_micro < need:
        raise ConfigError(
            f"{name} with pp={num_ranks} needs at least {need} micro-batches "
            f"(train.global_batch / train.micro_batch), got {num_micro}"
        )


class _RankOps:
    """Appends one rank's ops; counts micro-batches per stage, since every stage takes them in
    order (the k-th forward of a stage is micro-batch k, and so for backwards)."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._next_f: dict[int, int] = defaultdict(int)
        self._next_b: dict[int, int] = defaultdict(int)

    def _take(self, counter: dict[int, int], stage: int) -> int:
        counter[stage] += 1
        return counter[stage] - 1

    def f(self, stage: int) -> None:
        self.ops.append(Op("F", stage, self._take(self._next_f, stage)))

    def b(self, stage: int, defer: bool = False) -> None:
        self.ops.append(Op("B", stage, self._take(self._next_b, stage), defer_weight=defer))

    def fb(self, f_stage: int, b_stage: int) -> None:
        f_micro = self._take(self._next_f, f_stage)
        self.ops.append(Op("FB", f_stage, f_micro, b_stage, self._take(self._next_b, b_stage)))

    def w(self) -> None:
        self.ops.append(Op("W"))


def _dualpipev_rank(num_ranks: int, num_micro: int, rank: int) -> tuple[Op, ...]:
    """Rank `rank`'s ops: the 8 steps of DualPipeV.step() in deepseek-ai/DualPipe
    (dualpipe/dualpipev.py). Phase 0 is the stage on the way down, phase 1 the one on the way
    back up; the reference's `enable_zb=True` backwards are our deferred ones."""
    p, r = num_ranks, rank
    stage = (r, 2 * p - 1 - r)  # by phase
    ops = _RankOps()
    # Step 1: nF0 -- fill the way down; ranks further from the turn start earlier.
    for _ in range(2 * (p - r - 1)):
        ops.f(stage[0])
    # Step 2: nF0F1
    for _ in range(r + 1):
        ops.f(stage[0])
        ops.f(stage[1])
    # Step 3: nB1W1F1 -- zero bubble: the weight gradient runs at once, the input gradient
    # goes upstream first.
    for _ in range(p - r - 1):
        ops.b(stage[1], defer=True)
        ops.w()
        ops.f(stage[1])
    # Step 4 (main): nF0B1F1B0, overlapped pairs.
    for i in range(num_micro - 2 * p + r + 1):
        if i == 0 and r == p - 1:
            # The reference runs the turn's first pair apart "to further reduce bubble size".
            ops.f(stage[0])
            ops.b(stage[1])
        else:
            ops.fb(stage[0], stage[1])
        ops.fb(stage[1], stage[0])
    # Step 5: nB1F1B0
    for _ in range(p - r - 1):
        ops.b(stage[1])
        ops.fb(stage[1], stage[0])
    # Step 6: nB1B0 -- the second half defers weight gradients (switching before B1 on odd
    # ranks, between B1 and B0 on even ones), so that exactly r + 1 of them are queued.
    half = (r + 1) // 2
    for i in range(r + 1):
        ops.b(stage[1], defer=i > half or (i == half and r % 2 == 1))
        ops.b(stage[0], defer=i >= half)
    # Step 7: nWB0 -- weight gradients fill the wait for the gradients coming up.
    for _ in range(p - r - 1):
        ops.w()
        ops.b(stage[0], defer=True)
    # Step 8: nW -- drain the queue.
    for _ in range(r + 1):
        ops.w()
    return tuple(ops.ops)


def dualpipev(num_ranks: int, num_micro: int) -> Schedule:
    """DeepSeek's DualPipeV: 2P stages in a V, rank r holds stages r and 2P-1-r."""
    _check("dualpipev", num_ranks, num_micro)
    p = num_ranks
    return Schedule(
        name="dualpipev",
        num_ranks=p,
        num_micro=num_micro,
        num_stages=2 * p,
        stage_rank=tuple(range(p)) + tuple(reversed(range(p))),
        ops=tuple(_dualpipev_rank(p, num_micro, r) for r in range(p)),
    )


def one_f_one_b(num_ranks: int, num_micro: int) -> Schedule:
    """The classic 1F1B: P stages on P ranks; rank r warms up with P-1-r forwards, then
    alternates a forward and a backward, then drains the backwards."""
    _check("1f1b", num_ranks, num_micro)
    rank_ops = []
    for r in range(num_ranks):
        ops = _RankOps()
        warmup = num_ranks - 1 - r
        for _ in range(warmup):
            ops.f(r)
        for _ in range(num_micro - warmup):
            ops.f(r)
            ops.b(r)
        for _ in range(warmup):
            ops.b(r)
        rank_ops.append(tuple(ops.ops))
    return Schedule("1f1b", num_ranks, num_micro, num_ranks, tuple(range(num_ranks)), tuple(rank_ops))


def paired(num_micro: int) -> Schedule:
    """One rank holding the whole model as one stage: the first forward, then each next forward
    paired with the previous micro-batch's backward in an FB op, then the last backward — so that
    under expert parallelism one micro-batch's compute hides the other's all-to-alls (`runtime.py`),
    at the price of two micro-batches' activations in flight instead of one."""
    if num_micro < 2:
        raise ConfigError(f"paired forwards and backwards need at least 2 micro-batches, got {num_micro}")
    ops = _RankOps()
    ops.f(0)
    for _ in range(num_micro - 1):
        ops.fb(0, 0)
    ops.b(0)
    return Schedule("paired", 1, num_micro, 1, (0,), (tuple(ops.ops),))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"dualpipev": dualpipev, "1f1b": one_f_one_b}


def build_schedule(name: str, num_ranks: int, num_micro: int) -> Schedule:
    if name not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return SCHEDULES[name](num_ranks, num_micro)


def run_schedule(
    pp: int, name: str, overlap: bool, ep: int, dp_shard: int, num_micro: int, whole_step: bool = False
) -> Schedule | None:
    """The schedule a training run's step follows: `name` over pp > 1 ranks. Without a pipeline
    (pp = 1), under expert parallelism and without FSDP: `paired` with `overlap`
    (`parallel.pp_overlap`) and two micro-batches or more, else 1F1B on one rank where the step is
    captured as one CUDA graph (`whole_step`, `train.cuda_graphs`). Else None: each micro-batch's
    forward, then its backward, with no schedule."""
    if pp > 1:
        return build_schedule(name, pp, num_micro)
    if ep == 1 or dp_shard > 1:
        return None
    if overlap and num_micro >= 2:
        return paired(num_micro)
    return one_f_one_b(1, num_micro) if whole_step else None


# ---- analysis ------------------------------------------------------------------------------------


def _inputs(kind: str, stage: int, micro: int, last: int) -> list[tuple[str, int, int]]:
    """The (kind, stage, micro) results a forward or backward part waits for."""
    if kind == "F":
        return [("F", stage - 1, micro)] if stage > 0 else []
    return [("F", stage, micro)] + ([("B", stage + 1, micro)] if stage < last else [])


def messages(schedule: Schedule) -> dict[tuple[int, int], tuple[list, list]]:
    """Per directed rank pair (src, dst): (what src sends, what dst receives), each in op order;
    within an FB, the forward's message comes before the backward's. A message is
    ("act", from_stage, micro) or ("grad", from_stage, micro).

    The two orders match for 1F1B and for DualPipeV up to 2 ranks. For DualPipeV on 3 or more
    ranks they do not: rank r (0 < r < P-1) needs the activation for its first overlapped forward
    after step 3's backwards, whose gradients come from the same neighbour, sent later. The
    reference posts that one receive early (end of step 2). A runtime with in-order
    point-to-point matching must therefore receive each peer's messages in the peer's send order
    (the first list), keeping any that arrive before the op that needs them."""
    last, where = schedule.num_stages - 1, schedule.stage_rank
    traffic: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))
    for rank, ops in enumerate(schedule.ops):
        for op in ops:
            # An op receives all its inputs before it runs and sends its outputs after.
            for kind, stage, micro in parts(op):
                src = stage - 1 if kind == "F" else stage + 1
                if 0 <= src <= last and where[src] != rank:
                    tag = "act" if kind == "F" else "grad"
                    traffic[where[src], rank][1].append((tag, src, micro))
            for kind, stage, micro in parts(op):
                dst = stage + 1 if kind == "F" else stage - 1
                if 0 <= dst <= last and where[dst] != rank:
                    tag = "act" if kind == "F" else "grad"
                    traffic[rank, where[dst]][0].append((tag, stage, micro))
    return dict(traffic)


def peak_in_flight(schedule: Schedule) -> list[int]:
    """Per stage: the most micro-batches forwarded but not yet backwarded at once (the
    activations the stage holds), following each rank's op order."""
    held = [0] * schedule.num_stages
    peak = [0] * schedule.num_stages
    for ops in schedule.ops:
        for op in ops:
            for kind, stage, _ in parts(op):
                held[stage] += 1 if kind == "F" else -1
                peak[stage] = max(peak[stage], held[stage])
    return peak


@dataclass(frozen=True)
class Timeline:
    start: tuple[tuple[float, ...], ...]  # per rank, per op
    end: tuple[tuple[float, ...], ...]
    busy: tuple[float, ...]  # per rank: the time spent computing
    makespan: float  # when the last op of any rank ends: the step ends for all ranks together

    @property
    def bubble(self) -> tuple[float, ...]:
        """Per rank: the idle time within the step."""
        return tuple(self.makespan - busy for busy in self.busy)


def simulate(
    schedule: Schedule, f: float, b: float, w: float, fb: float | None = None, stage_time: list[float] | None = None
) -> Timeline:
    """Time the schedule: each rank runs its ops in order, an op starting once its rank is free
    and its inputs exist; communication is free. `b` is the input-gradient part of a backward,
    `w` its weight-gradient part. `stage_time`: each stage's cost relative to f, b and w (e.g. a
    partition's stage times; default 1 for all). Raises ValueError when no rank can proceed."""
    scale = stage_time or [1.0] * schedule.num_stages
    deferred: list[deque[int]] = [deque() for _ in schedule.ops]  # stages of the queued weight gradients

    def cost(op: Op, rank: int) -> float:
        rest = 0.0 if op.defer_weight else w
        if op.kind == "F":
            return f * scale[op.stage]
        if op.kind == "B":
            return (b + rest) * scale[op.stage]
        if op.kind == "W":
            return w * scale[deferred[rank].popleft()]
        if fb is not None:
            return fb
        return f * scale[op.stage] + (b + rest) * scale[op.b_stage]

    last = schedule.num_stages - 1
    done: dict[tuple[str, int, int], float] = {}  # a forward or backward part -> its end time
    queued = [0] * schedule.num_ranks  # deferred weight gradients not yet run, per rank
    pos = [0] * schedule.num_ranks
    free = [0.0] * schedule.num_ranks
    start: list[list[float]] = [[] for _ in schedule.ops]
    end: list[list[float]] = [[] for _ in schedule.ops]
    # An op's start depends only on ends already known, so scheduling whatever is ready, rank by
    # rank, gives the same times as a real clock would.
    while any(pos[r] < len(ops) for r, ops in enumerate(schedule.ops)):
        progressed = False
        for rank, ops in enumerate(schedule.ops):
            while pos[rank] < len(ops):
                op = ops[pos[rank]]
                needs = [x for part in parts(op) for x in _inputs(*part, last)]
                if any(x not in done for x in needs):
                    break
                if op.kind == "W":
                    if queued[rank] == 0:
                        raise ValueError(f"rank {rank} op {pos[rank]}: W with no deferred backward queued")
                    queued[rank] -= 1
                elif op.defer_weight:
                    queued[rank] += 1
                    deferred[rank].append(op.stage if op.kind == "B" else op.b_stage)
                t0 = max([free[rank]] + [done[x] for x in needs])
                free[rank] = t0 + cost(op, rank)
                for part in parts(op):
                    done[part] = free[rank]
                start[rank].append(t0)
                end[rank].append(free[rank])
                pos[rank] += 1
                progressed = True
        if not progressed:
            waiting = {r: ops[pos[r]] for r, ops in enumerate(schedule.ops) if pos[r] < len(ops)}
            raise ValueError(f"pipeline schedule {schedule.name} deadlocks; ranks wait at {waiting}")
    busy = tuple(sum(e - s for s, e in zip(st, en)) for st, en in zip(start, end))
    return Timeline(
        start=tuple(map(tuple, start)),
        end=tuple(map(tuple, end)),
        busy=busy,
        makespan=max(free),
    )
