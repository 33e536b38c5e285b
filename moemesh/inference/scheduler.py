"""Continuous batching with a token budget per step: requests wait in a bounded queue; each step
runs one forward of at most `max_num_batched_tokens` tokens — first one token of every running
sequence that is decoding, then chunks of the prompts being prefilled, oldest first, then new
requests admitted while a table row, blocks and budget remain — so that decoding never stalls
behind a long prompt, and several prompts are prefilled in one forward. A finished or cancelled
request gives its row and blocks back at once.

Whole prompts. A new prompt joins a round that computes other prompts' tokens only if all of it
fits; else it waits for the next round, where it comes first. Split, its first token would wait
for that next round all the same, and this round would be longer for everyone in it. A prompt
longer than what a round of decode tokens leaves still starts in such a round and goes on in
chunks. On the 48-layer shape with the random weights' routing (one H200, docs/benchmarks.md)
this took serve's first token p50 from 50 to 43 ms with drifting clients, for 1.6% of the
tokens/s. Its effect is larger with a smaller budget: there a split prompt is a large share of its
rounds. At 1,024 tokens a step with clients in step, splitting made the first token slower than at
2,048 (88 against 66 ms), and whole prompts made it faster (41 ms). The price is a burst's last
first tokens: 64 prompts arriving together were admitted 3 a round rather than 4.

Prefill first (`prefill_first`, serve's `--schedule prefill-first`). A mixed round costs its
decode tokens' time too, so a prompt admitted beside 60 decoding sequences reaches its first
token after a round about twice as long as its prefill alone. With `prefill_first`, a round
that decoded while prompts wait is followed by a round of the prompts alone (their chunks, then
new requests, within the budget), and that by a round of the decode tokens alone: the first
token waits for no one's decoding, and decoding waits for at most one prompts' round at a time
(what SGLang does by default; vLLM mixes). The price is the experts' weights read twice, by a
round of their own for the decode tokens rather than once shared with the prompts'. On the
48-layer shape with drifting clients (H100, docs/benchmarks.md) that halved TTFT p50 for 5% of the
tokens/s under the random weights' routing, but cost 16% where routing is spread as a trained
model's and mixed already gave 1.7× one prompt's prefill: so mixed stays the default.

A sequence's tokens are its prompt and what it has sampled; `computed` counts those whose keys
and values are in the cache. A step computes the next ones; when that reaches the last token,
its logits sample the next. Prefill, decode and recomputation are the same operation.

Blocks (inference/blocks.py): a sequence holds those of its computed and scheduled entries; a
new request first takes the blocks of its prompt's longest cached prefix (prefix caching), at
least its last token left to compute (its logits are needed). When a running sequence needs a
block and none is free, the youngest running sequence not in this step is preempted — its blocks
released, its row given back, and it returns to the front of the queue with its tokens so far,
recomputed when it is admitted again (its full blocks stay in the prefix cache meanwhile, so
re-admission may find them). Recompute, not swap, by measurement (bench/serve/decode.py --preemption, one H200,
the 48-layer shape): with a quarter of the blocks a run needs, recomputing costs 5.5% of what the
small pool adds, swap's copies alone half of that, and the rest is fewer sequences at once, which
swapping would not change. A request that does not fit waits. None is lost: a sequence leaves
only finished, cancelled or failed.

Overlap (`overlap`, the default; serve's `--no-overlap` turns it off). A round's step is launched
before the last round's tokens are read: the host schedules, builds and launches round k+1 while
the device runs round k, then reads round k's tokens and processes them (text, stops, callbacks)
while round k+1 runs, as vLLM's async scheduling does. A sequence whose token is still on the
device decodes it as PREVIOUS (the engine takes its own last sample for that row), its sampling
step counted as if it were read; a sequence that ends meanwhile (a stop token, a stop string, a
cancel) computes one token too many, dropped when it is read; one whose token in flight will be
its last (max_tokens, the context) is not scheduled again. Rounds stay synchronous where the
host must see a step's output before the next: a request processed on the host (penalties,
biases, grammars, log-probabilities), prompt log-probabilities, routing records; and preemption
reads the round in flight first (a preempted sequence's tokens must all be known). The price: a
request that arrives, or a reply that comes, while a step runs joins the round after next. On
two H200s under tensor parallelism (the 48-layer Qwen3-30B-A3B shape, `bench/serve/serve_load.py --tp 2`,
64 streaming clients; docs/benchmarks.md, 2026-11-28, ninth session) served tokens/s rose 25% and
27% in two calls (3,182 -> 3,964 beside the code before; 3,089 -> 3,910 against --no-overlap), the
first token's p50 44 -> 62 ms in the first, 72 -> 64 in the second; the engine's decode step alone
lost the host's turn between steps (0.1-0.5 ms) and is its CUDA graph alone.

`step` is one round; `run_until_idle` drives it for a batch job (`moemesh generate`),
`serve_forever` for the server, on its own thread, sleeping while there is nothing to do.
`submit` may be called from any thread; a full queue raises QueueFull (the server's 503).

The reply window (`reply_window_s`, for `serve_forever`). A round runs tens of milliseconds when it
prefills, and a request that arrives while one runs waits for it to end. The requests most
likely to arrive are the next ones of the clients whose requests just finished: agents, pipelines
and load generators answer within a few milliseconds. So after a round that finished requests,
the next one waits until as many new requests came, or the window passed. Those then join the
round they would have joined had their clients answered at once, not the one after it: under a
closed-loop load of 64 clients this halves the first token's wait (docs/benchmarks.md; serve's
25 ms: 64 streaming clients on an H100 host answered in 10-25 ms). Its cost is the GPU idle for
at most the window after such a round. Where clients do not answer at once
(people typing), the windows that get no reply at all may take at most MISSED_WINDOWS_SHARE of
the time (5%, over about the last second); beyond it, finishing rounds go on without one. Hits
(a reply came) are not limited: a closed loop keeps its windows. (Skipping windows after
misses instead lost the whole gain on the 48-layer shape: docs/benchmarks.md.) With overlap the
window waits while the next round's step runs, and takes that round when its step ends.

Routing (`record_routing`, for reinforcement learning's comparison of the engine with the
trainer: train/logprobs.py): each step's forward records the experts every MoE layer chose for
each of its tokens (`models.moe.RoutingRecorder`), and the scheduler files them under their
sequence's positions in `Sequence.routing`. Positions taken from the prefix cache were computed
for another sequence and are not filed; a preempted sequence's recomputed ones are filed again.
Eager engines only (no CUDA graphs: a replay records nothing). The engine's model records from
then on, whoever runs it, until `scheduler.routing.stop()`.

A request's failure is that request's alone: what is done for one row after the engine's step
(processing.py: penalties, biases, grammars, log-probabilities; its text and stops) runs under
its own guard, and a row that raises finishes with "error" while the others go on. Only a
failing engine step (the model or the device) fails every request in it; a round that fails
before any request runs fails the oldest waiting one, the one it was admitting.
"""

from __future__ import annotations

import heapq
import math
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moemesh.data.tokenizer import Tokenizer
from moemesh.inference.blocks import block_key
from moemesh.inference.engine import PREVIOUS, Chunk, DecodeEngine, Launched
from moemesh.inference.grammar import Grammars
from moemesh.inference.processing import FLOOR, RowSampler
from moemesh.inference.request import Logprob, QueueFull, SamplingParams, Sequence, check_request
from moemesh.inference.sampling import token_logprobs
from moemesh.models.moe import RoutingRecorder

MISSED_WINDOWS_SHARE = 0.05  # of the time, at most, in reply windows that got no reply
WINDOW_POLL_S = 5e-4  # how often a reply window looks whether the launched round's step has ended


@dataclass
class Held:
    """A running sequence's hold on the cache."""

    blocks: list[int]
    keys: list[int] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    computed: int = 0  # tokens whose keys and values are in the cache (or will be: a launched step's)


@dataclass
class Round:
    """A launched step: its (sequence, tokens) and chunks, and whether the host must process its
    tokens or logits before the next round is scheduled (`needs_host`)."""

    work: list[tuple[Sequence, int]]
    chunks: list[Chunk]
    launched: Launched
    needs_host: bool
    routing: torch.Tensor | None = None
    sampling: set[Sequence] = field(init=False)  # the sequences whose next token it samples

    def __post_init__(self):
        self.sampling = {sequence for (sequence, _), chunk in zip(self.work, self.chunks) if chunk.sample}


class Scheduler:
    def __init__(
        self,
        engine: DecodeEngine,
        tokenizer: Tokenizer,
        max_waiting: int = 64,
        reply_window_s: float = 0.0,
        prefill_first: bool = False,
        record_routing: bool = False,
        overlap: bool = True,
    ):
        self.engine, self.tokenizer, self.max_waiting = engine, tokenizer, max_waiting
        self.overlap = overlap
        self._launched: Round | None = None  # the round whose tokens the host has not read yet
        if record_routing and engine.cuda_graphs:
            raise ValueError(
                "record_routing needs an eager engine (cuda_graphs=False): a graph's replay records nothing"
            )
        self.routing = RoutingRecorder(engine.model).start() if record_routing else None
        self.reply_window_s, self.prefill_first = reply_window_s, prefill_first
        self._prompts_round = False  # the last round computed prompts alone (prefill_first)
        self.pool = engine.blocks
        self.free_rows = list(range(engine.max_batch))  # a heap: the lowest row first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in order of admission
        self.held: dict[Sequence, Held] = {}
        self.decode_batches: Counter[int] = Counter()  # sequences in a step -> how many steps had that many
        self.preemptions = 0
        self.prompt_tokens = self.cached_tokens = 0  # admitted; of them found in the prefix cache
        self.submitted = 0  # requests queued so far
        self.finished = 0  # requests that ended (not cancelled) so far
        self.reply_windows: Counter[str] = Counter()  # how each ended: caught, partly, missed or skipped
        self._missed_s = 0.0  # time in reply windows that got no reply, decayed with a 1-s time constant
        self._missed_at = 0.0  # when _missed_s was last decayed
        self.closed = False
        self._wake = threading.Condition()
        self.grammars = Grammars(tokenizer, engine.vocab)

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, on_update: Callable[[Sequence, str], None] | None = None
    ) -> Sequence:
        """Queue a request (RequestError if it cannot run, QueueFull if the queue is full)."""
        check_request(prompt_ids, params, self.engine.max_len, self.engine.vocab)
        sequence = Sequence(prompt_ids, params, self.tokenizer, on_update)
        if params.processed:
            stops = frozenset(sequence.stop_ids)
            matcher = None if params.grammar is None else self.grammars.matcher(params.grammar, stops)
            sequence.sampler = RowSampler(params, prompt_ids, self.engine.vocab, self.engine.device, matcher, stops)
        with self._wake:
            if self.closed:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting already (the limit)")
            self.waiting.append(sequence)
            self.submitted += 1
            self._wake.notify()
        return sequence

    def step(self) -> bool:
        """One round; False when there was nothing to do. With `overlap` the round's step is
        launched before the last round's tokens are read (the module's docstring says when not)."""
        with self._wake:
            for sequence in [s for s in self.waiting if s.cancelled]:
                self.waiting.remove(sequence)
                sequence.finish("cancelled")
        self._retire()
        work = self._schedule()
        if not work:
            if self._launched is None:
                return False
            self._settle()
            return True
        chunks = [self._chunk(sequence, count) for sequence, count in work]
        self.decode_batches[len(work)] += 1
        if self.routing is not None:
            self.routing.take()  # drop what forwards outside the rounds recorded (a warm-up)
        launched = self.engine.launch(chunks)
        needs_host = self.routing is not None or any(
            s.sampler is not None or c.all_logits for (s, _), c in zip(work, chunks)
        )
        routing = self.routing.take() if self.routing is not None else None  # [tokens, layers, k], chunk by chunk
        previous, self._launched = self._launched, Round(work, chunks, launched, needs_host, routing)
        for sequence, count in work:  # its blocks' keys and values on their way
            self.held[sequence].computed += count
            self._register(sequence, self.held[sequence])
        if previous is not None:
            self._take_round(previous)
        self._retire()
        if not self.overlap or needs_host or not self.running:
            self._settle()
        return True

    def _chunk(self, sequence: Sequence, count: int) -> Chunk:
        """The sequence's next `count` tokens as a chunk; one not read yet is PREVIOUS."""
        computed, end = self.held[sequence].computed, self._end(sequence)
        known = _tokens(sequence, computed, min(computed + count, _length(sequence)))
        return Chunk(
            sequence.row,
            known + [PREVIOUS] * (count - len(known)),
            computed,
            computed + count == end,
            len(sequence.token_ids) + self._in_flight(sequence),
            sequence.params.sampling,
            _wants_prompt_logprobs(sequence, computed),
        )

    def _in_flight(self, sequence: Sequence) -> bool:
        """Whether the launched round samples the sequence's next token (not read yet). Only one
        round is launched while rounds are scheduled: the one before was read when it launched."""
        return self._launched is not None and sequence in self._launched.sampling

    def _end(self, sequence: Sequence) -> int:
        """The sequence's length with its token in flight."""
        return _length(sequence) + self._in_flight(sequence)

    def _settle(self, keep: set[Sequence] | frozenset = frozenset()) -> None:
        """The launched round's tokens read and taken (the host waits for its step), and the
        requests that ended given back (not those in `keep`)."""
        launched, self._launched = self._launched, None
        if launched is not None:
            self._take_round(launched)
        self._retire(keep)

    def _take_round(self, round: Round) -> None:
        """A round's tokens to its sequences: those that ended meanwhile (finished, cancelled or
        preempted) drop theirs, the token a step past their end."""
        tokens = round.launched.tokens()
        sampled = offset = 0
        for i, ((sequence, count), chunk) in enumerate(zip(round.work, round.chunks)):
            if round.routing is not None:
                for j in range(count):
                    sequence.routing[chunk.start + j] = round.routing[offset + j]
                offset += count
            held = self.held.get(sequence)
            if chunk.all_logits and held is not None:
                self._prompt_logprobs(sequence, chunk, round.launched.all_logits[i])
            if chunk.sample:
                if sequence.finish_reason is None and held is not None:
                    self._take(sequence, tokens[sampled], round.launched.logits[sampled])
                sampled += 1

    def run_until_idle(self) -> None:
        while self.step():
            pass

    def serve_forever(self, keep_alive_s: float = 30.0, after_step: Callable[[], None] | None = None) -> None:
        """Run rounds until `close`; a failing round fails the requests in it, and serving goes on.
        Idle, it tells the engine every keep_alive_s that it is alive (tensor-parallel followers).
        `after_step` runs after every round (the server hands that round's updates over at once).
        After a round that finished requests, the next waits up to `reply_window_s` for as many
        new ones (the module's docstring says why)."""
        while True:
            with self._wake:
                while not (self.closed or self.waiting or self.running):
                    if not self._wake.wait(timeout=keep_alive_s):
                        self.engine.keep_alive()
                if self.closed:
                    break
            finished = self.finished
            try:
                self.step()
            except Exception:  # a bug or a device error: report it to the requests, keep serving
                error = traceback.format_exc()
                print(error, flush=True)
                self._fail_round(error.strip().splitlines()[-1])
            submitted = self.submitted  # before its updates are out: no reply can have come yet
            if after_step is not None:
                after_step()
            if self.reply_window_s > 0 and self.finished > finished:
                self._reply_window(submitted, self.finished - finished, after_step)
        for sequence in [*self.waiting, *self.running]:
            sequence.finish("cancelled")
        self._retire()
        if after_step is not None:
            after_step()

    def _reply_window(self, submitted: int, expected: int, after_step: Callable[[], None] | None = None) -> None:
        """Wait until `expected` requests came after the first `submitted`, or the window passed,
        or `close`; not at all while missed windows are over their share of the time. Counts in
        `reply_windows` how it ended: all `expected` caught, partly, missed (not one) or skipped.
        A launched round whose step ends meanwhile is taken then (and `after_step` run), not
        held back until the window ends."""
        start = time.monotonic()
        self._missed_s *= math.exp(self._missed_at - start)  # a 1-s memory: the sum is the last second's
        self._missed_at = start
        if self._missed_s > MISSED_WINDOWS_SHARE:
            self.reply_windows["skipped"] += 1
            return
        deadline, wanted = start + self.reply_window_s, submitted + expected
        while True:
            with self._wake:
                if self.closed or self.submitted >= wanted or (left := deadline - time.monotonic()) <= 0:
                    came = self.submitted - submitted
                    break
                self._wake.wait(timeout=left if self._launched is None else min(left, WINDOW_POLL_S))
            if self._launched is not None and self._launched.launched.done():
                self._settle()
                if after_step is not None:
                    after_step()
        self.reply_windows["caught" if came >= expected else "partly" if came else "missed"] += 1
        if not came:
            self._missed_s += time.monotonic() - start

    def _fail_round(self, error: str) -> None:
        """A round raised: its requests fail. When none was running yet, the oldest waiting one
        (the round was admitting it), so that a failure that repeats every round ends instead of
        holding the queue."""
        self._launched = None
        failed = list(self.running)
        with self._wake:
            if not failed and self.waiting:
                failed.append(self.waiting.popleft())
        for sequence in failed:
            sequence.finish("error", error)
        self._retire()

    def close(self) -> None:
        with self._wake:
            self.closed = True
            self._wake.notify()

    # ---- inside ----------------------------------------------------------------------------------
    def _schedule(self) -> list[tuple[Sequence, int]]:
        """This step's (sequence, tokens to compute), within the token budget: a mixed round, or
        with `prefill_first` a prompts' round after every round that decoded while prompts wait
        (the module's docstring says why)."""
        decoding, prefilling = [], []
        for sequence in self.running:  # in order of admission
            (prefilling if self._end(sequence) - self.held[sequence].computed > 1 else decoding).append(sequence)
        last_was_prompts, self._prompts_round = self._prompts_round, False
        if not (self.prefill_first and decoding):
            return self._fill(decoding + prefilling, admit=True)
        if not last_was_prompts and (work := self._fill(prefilling, admit=True)):  # empty: no prompt can run
            self._prompts_round = True
            return work
        return self._fill(decoding, admit=False)

    def _fill(self, sequences: list[Sequence], admit: bool) -> list[tuple[Sequence, int]]:
        """The sequences' next tokens in order, then (`admit`) new requests, within the budget."""
        budget = self.engine.max_num_batched_tokens
        work: list[tuple[Sequence, int]] = []
        scheduled: set[Sequence] = set()
        prompts = False  # this round computes prompt tokens: a new prompt joins it only whole
        for sequence in sequences:
            if budget == 0:
                break
            if sequence not in self.held or self._last_in_flight(sequence):  # preempted; ends with its token in flight
                continue
            left = self._end(sequence) - self.held[sequence].computed
            count = min(left, budget)
            if self._grow(sequence, self.held[sequence].computed + count, scheduled):
                work.append((sequence, count))
                scheduled.add(sequence)
                budget -= count
                prompts |= left > 1
        while admit and budget > 0 and self.free_rows:
            admitted = self._admit(budget, whole=prompts)
            if admitted is None:
                break
            work.append(admitted)
            budget -= admitted[1]
            prompts = True
        return work

    def _admit(self, budget: int, whole: bool) -> tuple[Sequence, int] | None:
        """The first waiting request into a row, with its cached prefix and blocks for its first
        chunk; None if there is none, its blocks are not free, or (`whole`) its prompt does not fit
        the budget left: then it waits."""
        with self._wake:
            if not self.waiting:
                return None
            sequence = self.waiting[0]
        length, size = _length(sequence), self.pool.block_size
        blocks, keys = [], []
        if not _wants_prompt_logprobs(sequence, 0):  # those need every prompt token's logits
            blocks, keys = self.pool.match(_tokens(sequence, 0, length))
        if len(blocks) * size >= length:  # the last token is computed again: its logits are needed
            self.pool.release(blocks[-1:])
            blocks, keys = blocks[:-1], keys[:-1]
        computed = len(blocks) * size
        count = min(length - computed, budget)
        need = math.ceil((computed + count) / size) - len(blocks)
        if need > self.pool.num_free or (whole and count < length - computed):
            self.pool.release(blocks)
            return None
        with self._wake:
            self.waiting.popleft()
        sequence.row = heapq.heappop(self.free_rows)
        self.held[sequence] = Held(blocks + self.pool.allocate(need), keys, computed)
        self.running.append(sequence)
        self.engine.set_blocks(sequence.row, self.held[sequence].blocks)
        self.prompt_tokens += length
        self.cached_tokens += computed
        return sequence, count

    def _last_in_flight(self, sequence: Sequence) -> bool:
        """Whether the token in flight for the sequence will be its last (max_tokens, the context)."""
        return self._in_flight(sequence) and (
            len(sequence.token_ids) + 1 >= sequence.params.max_tokens or _length(sequence) + 1 >= self.engine.max_len
        )

    def _grow(self, sequence: Sequence, entries: int, scheduled: set[Sequence]) -> bool:
        """Blocks for `entries` of the sequence, preempting the youngest running sequences not in
        this step while none is free; False if the sequence itself had to go (or ended: a preempted
        sequence's tokens must all be known, so the launched round is taken first)."""
        held = self.held[sequence]
        need = math.ceil(entries / self.pool.block_size) - len(held.blocks)
        if need > self.pool.num_free and self._launched is not None:
            self._settle(keep=scheduled)
            if sequence not in self.held:
                return False
        while need > self.pool.num_free:
            victim = next((s for s in reversed(self.running) if s not in scheduled and s is not sequence), None)
            self._preempt(sequence if victim is None else victim)
            if victim is None:
                return False
        if need > 0:
            held.blocks += self.pool.allocate(need)
            self.engine.set_blocks(sequence.row, held.blocks)
        return True

    def _preempt(self, sequence: Sequence) -> None:
        self._release(sequence)
        self.preemptions += 1
        with self._wake:
            self.waiting.appendleft(sequence)

    def _register(self, sequence: Sequence, held: Held) -> None:
        """Key the sequence's newly full blocks in the prefix cache (of its tokens known)."""
        if not self.pool.prefix_caching:
            return
        size = self.pool.block_size
        for i in range(len(held.keys), min(held.computed, _length(sequence)) // size):
            tokens = _tokens(sequence, i * size, (i + 1) * size)
            held.keys.append(block_key(held.keys[-1] if held.keys else None, tokens))
            self.pool.register(held.blocks[i], held.keys[-1], tokens)

    def _release(self, sequence: Sequence) -> None:
        """Give the sequence's blocks and row back."""
        self.pool.release(self.held.pop(sequence).blocks)
        self.running.remove(sequence)
        heapq.heappush(self.free_rows, sequence.row)
        sequence.row = None

    def _take(self, sequence: Sequence, token: int, logits: torch.Tensor) -> None:
        """The row's token after the step: processed when it asks for it, then added."""
        with self._guard(sequence):
            if sequence.params.max_tokens == 0:  # the prompt's log-probabilities alone
                sequence.finish("length")
                return
            logprob = None
            if sequence.sampler is not None:
                token, logprob = sequence.sampler.choose(logits, token, len(sequence.token_ids))
            sequence.add(token, self.engine.max_len, logprob)

    class _guard:
        """Fail one request, not the step, when its own work raises."""

        def __init__(self, sequence: Sequence):
            self.sequence = sequence

        def __enter__(self):
            return self

        def __exit__(self, kind, error, tb):
            if error is None or not isinstance(error, Exception):
                return False
            print("".join(traceback.format_exception(kind, error, tb)), flush=True)
            try:
                self.sequence.finish("error", f"{kind.__name__}: {error}")
            except Exception:  # its listener is gone too
                self.sequence.finish_reason = "error"
            return True

    def _prompt_logprobs(self, sequence: Sequence, chunk: Chunk, logits: torch.Tensor) -> None:
        """The log-probabilities of the prompt tokens after the chunk's, from its logits."""
        with self._guard(sequence):
            targets = sequence.prompt_ids[chunk.start + 1 : chunk.start + 1 + len(chunk.tokens)]
            ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
            found = token_logprobs(logits[: len(targets)], ids, sequence.params.prompt_logprobs)
            sequence.prompt_logprobs = (sequence.prompt_logprobs or [None]) + _logprobs(*found)

    def _retire(self, keep: set[Sequence] | frozenset = frozenset()) -> None:
        """Give the rows and blocks of finished and cancelled requests back (not those in `keep`)."""
        for sequence in [s for s in self.running if (s.cancelled or s.finish_reason is not None) and s not in keep]:
            sequence.finish("cancelled")
            self.finished += sequence.finish_reason != "cancelled"
            self._release(sequence)


def _logprobs(chosen: torch.Tensor, ids: torch.Tensor, top: torch.Tensor) -> list[Logprob]:
    """sampling.token_logprobs's tensors as one Logprob a token (-inf as processing.FLOOR)."""
    return [
        Logprob(max(c, FLOOR), tuple((i, max(v, FLOOR)) for i, v in zip(row_ids, row_top)))
        for c, row_ids, row_top in zip(chosen.tolist(), ids.tolist(), top.tolist())
    ]


def _length(sequence: Sequence) -> int:
    return len(sequence.prompt_ids) + len(sequence.token_ids)


def _tokens(sequence: Sequence, start: int, end: int) -> list[int]:
    """The sequence's tokens start..end-1, of its prompt and then of what it sampled."""
    prompt = len(sequence.prompt_ids)
    if end <= prompt:
        return sequence.prompt_ids[start:end]
    if start >= prompt:
        return sequence.token_ids[start - prompt : end - prompt]
    return sequence.prompt_ids[start:] + sequence.token_ids[: end - prompt]


def _wants_prompt_logprobs(sequence: Sequence, computed: int) -> bool:
    """Whether a chunk from `computed` on must keep its logits: the request asks for its prompt's
    log-probabilities and they are known up to there only (not again after a preemption)."""
    known = max(len(sequence.prompt_logprobs), 1)  # the first token's is None
    return sequence.params.prompt_logprobs is not None and known == computed + 1 < len(sequence.prompt_ids)
