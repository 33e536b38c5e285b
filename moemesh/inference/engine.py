"""The decode engine: a model, its static KV cache, and one step that feeds every running
sequence its last token and samples the next — captured as a CUDA graph where there is a GPU.

Rows of the cache are sequences. A prompt is prefilled alone into its row (in chunks, eagerly);
then all rows decode together, each at its own position. A decode step runs the first B rows,
B the smallest of a few captured batch sizes (1, 2, 4, ... max_batch) that covers the highest
row in use — the scheduler hands out the lowest free rows, so B follows the number of running
sequences — and attends over the first kv_len cache entries, kv_len a power of two covering the
furthest position. Rows in between that run nothing are padding: they write a key at position 0
of a free row, which the next prefill of that row overwrites.

Each (B, kv_len, sampling mode) gets its own CUDA graph, captured on first use (after one eager
warm-up run on a side stream) and replayed from then on: a step is then two small host-to-device
copies (tokens, positions, sampling settings), one replay and one read of the B new tokens — the
only synchronisation. On a CPU the same step runs eagerly.

Each operation keeps the logits it sampled from (`last_logits`: [rows, V], read before the next
call), so that requests with penalties, biases, grammars or log-probabilities can be processed
after the step (processing.py); a prefill can also give the prompt's own log-probabilities
(`last_prompt_logprobs`, from the logits of every prompt position).

Under tensor parallelism every rank holds an engine over its shard; the rank that schedules
(rank 0 of the group) broadcasts each prefill's and step's inputs first, and the others, in
`follow`, run the same calls — collectives inside the model then pair up, and every rank
samples the same tokens from the same gathered logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from moemesh.inference.sampling import MODES, mode_for, sample, token_logprobs
from moemesh.models import KVCache, MoECausalLM
from moemesh.parallel import comm

_PREFILL, _DECODE, _STOP, _KEEP_ALIVE = 1, 2, 3, 4


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class RowStep:
    """One running sequence's input to a decode step."""

    row: int
    token: int  # its last token, not yet in the cache
    position: int  # where that token goes
    step: int  # tokens it has sampled so far (the sampling noise's counter)
    sampling: Sampling


class DecodeEngine:
    def __init__(
        self,
        model: MoECausalLM,
        max_batch: int = 16,
        max_len: int | None = None,
        cuda_graphs: bool | None = None,
        prefill_chunk: int = 1024,
        group=None,
    ):
        self.model = model
        self.device = next(model.parameters()).device
        limit = model.config.max_position_embeddings
        self.max_len = min(max_len or limit, limit)
        self.max_batch = max_batch
        self.batch_sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        # 64, 128, ... up to max_len: attention reads at most twice the entries in use
        self.kv_lens = sorted(
            {min(1 << i, self.max_len) for i in range(6, self.max_len.bit_length() + 1)} | {self.max_len}
        )
        self.cache = KVCache(max_batch, self.max_len)
        self.prefill_chunk = prefill_chunk
        self.group = group
        self.leader = group is None or dist.get_rank(group) == 0
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs: dict[tuple[int, int, str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        # The step's inputs, where a captured graph reads them: per row (token, position, seed,
        # step) and (temperature, top_p).
        self.ints = torch.zeros(max_batch, 4, dtype=torch.long, device=self.device)
        self.floats = torch.zeros(max_batch, 2, dtype=torch.float32, device=self.device)
        self.vocab = model.config.vocab_size
        self.last_logits: torch.Tensor | None = None  # [rows, V] of the last prefill (1 row) or decode step
        self.last_prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ---- the two operations ----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, row: int, prompt_ids: list[int], sampling: Sampling, prompt_logprobs: int | None = None) -> int:
        """Put a prompt into cache row `row` (positions 0..len-1) and sample its first new token.
        With `prompt_logprobs` = k, `last_prompt_logprobs` holds, for prompt tokens 1..len-1,
        their log-probabilities and the k likeliest tokens' (sampling.token_logprobs, at
        temperature 1, unprocessed)."""
        if not 0 < len(prompt_ids) <= self.max_len or not 0 <= row < self.max_batch:
            raise ValueError(
                f"prefill of {len(prompt_ids)} tokens into row {row}: the cache has "
                f"{self.max_batch} rows of {self.max_len}"
            )
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        k = -1 if prompt_logprobs is None else prompt_logprobs
        settings = torch.tensor([sampling.temperature, sampling.top_p, k], dtype=torch.float64, device=self.device)
        self._announce(_PREFILL, row, len(prompt_ids), sampling.seed, ids, settings)
        return int(self._prefill(row, ids, sampling, prompt_logprobs))

    @torch.no_grad()
    def decode(self, rows: list[RowStep]) -> list[int]:
        """One step of every given row: the token each samples next, in the order given."""
        batch = next(b for b in self.batch_sizes if b > max(r.row for r in rows))
        end = max(r.position for r in rows) + 1
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is beyond the cache's {self.max_len} entries")
        kv_len = next(n for n in self.kv_lens if n >= end)
        mode = mode_for([r.sampling.temperature for r in rows], [r.sampling.top_p for r in rows])
        ints, floats = [[0, 0, 0, 0]] * batch, [[0.0, 1.0]] * batch  # padding rows: token 0 at position 0, greedy
        for r in rows:
            ints[r.row] = [r.token, r.position, r.sampling.seed, r.step]
            floats[r.row] = [r.sampling.temperature, r.sampling.top_p]
        self.ints[:batch].copy_(torch.tensor(ints), non_blocking=True)
        self.floats[:batch].copy_(torch.tensor(floats), non_blocking=True)
        self._announce(_DECODE, batch, kv_len, MODES.index(mode))
        tokens, self.last_logits = self._run(batch, kv_len, mode)
        tokens = tokens.tolist()
        return [tokens[r.row] for r in rows]

    @torch.no_grad()
    def warm_up(self) -> float:
        """One greedy step at every batch size, while no sequence runs (padding rows only), so
        that the kernels are compiled and their tiles tuned (seconds each on a GPU) before the
        first requests rather than inside them. Returns the seconds it took."""
        start = time.perf_counter()
        kv_len = self.kv_lens[0]
        for batch in self.batch_sizes:
            self.ints[:batch] = 0
            self.floats[:batch] = torch.tensor([0.0, 1.0])
            self._announce(_DECODE, batch, kv_len, MODES.index("greedy"))
            self._run(batch, kv_len, "greedy")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def keep_alive(self) -> None:
        """Tell the followers the leader is alive though idle: their wait for the next step
        would otherwise hit the process group's timeout."""
        self._announce(_KEEP_ALIVE)

    def close(self) -> None:
        """Release the followers of a tensor-parallel group (the leader calls it once, at the end)."""
        self._announce(_STOP)

    def follow(self) -> None:
        """On a tensor-parallel rank other than the leader: run what the leader announces, until it closes."""
        while True:
            header = comm.broadcast_(torch.zeros(4, dtype=torch.long, device=self.device), self.group)
            op, a, b, c = header.tolist()
            if op == _STOP:
                return
            if op == _KEEP_ALIVE:
                continue
            with torch.no_grad():
                if op == _PREFILL:
                    ids = comm.broadcast_(torch.empty(b, dtype=torch.long, device=self.device), self.group)
                    settings = comm.broadcast_(torch.empty(3, dtype=torch.float64, device=self.device), self.group)
                    temperature, top_p, k = settings.tolist()
                    self._prefill(a, ids, Sampling(temperature, top_p, seed=c), None if k < 0 else int(k))
                else:
                    comm.broadcast_(self.ints[:a], self.group)
                    comm.broadcast_(self.floats[:a], self.group)
                    self._run(a, b, MODES[c])

    # ---- inside ----------------------------------------------------------------------------------
    def _announce(self, op: int, a: int = 0, b: int = 0, c: int = 0, *tensors: torch.Tensor) -> None:
        if self.group is None:
            return
        comm.broadcast_(torch.tensor([op, a, b, c], dtype=torch.long, device=self.device), self.group)
        if op == _DECODE:
            tensors = (self.ints[:a], self.floats[:a])
        for t in tensors:
            comm.broadcast_(t, self.group)

    def _prefill(self, row: int, ids: torch.Tensor, sampling: Sampling, prompt_logprobs: int | None) -> torch.Tensor:
        self.cache.row_start = row
        pieces = []
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            self.cache.kv_len = start + len(chunk)
            positions = torch.arange(start, start + len(chunk), device=self.device)[None]
            every = prompt_logprobs is not None
            logits = self.model.next_token_logits(chunk[None], self.cache, positions, all_positions=every)
            if every:  # position t's logits give token t + 1's log-probability
                targets = ids[start + 1 : start + 1 + len(chunk)]
                pieces.append(token_logprobs(logits[0, : len(targets)], targets, prompt_logprobs))
                logits = logits[:, -1]
        if pieces:
            self.last_prompt_logprobs = tuple(torch.cat(parts) for parts in zip(*pieces))
        self.last_logits = logits
        mode = mode_for([sampling.temperature], [sampling.top_p])
        floats = torch.tensor([sampling.temperature, sampling.top_p], device=self.device)
        ints = torch.tensor([sampling.seed, 0], device=self.device)  # step 0: the first sampled token
        return sample(logits, floats[:1], floats[1:], ints[:1], ints[1:], mode)[0]

    def _step(self, batch: int, kv_len: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens, the logits they were sampled from)."""
        ints, floats = self.ints[:batch], self.floats[:batch]
        self.cache.row_start, self.cache.kv_len = 0, kv_len
        logits = self.model.next_token_logits(ints[:, :1], self.cache, ints[:, 1:2])
        return sample(logits, floats[:, 0], floats[:, 1], ints[:, 2], ints[:, 3], mode), logits

    def _run(self, batch: int, kv_len: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.cuda_graphs:
            return self._step(batch, kv_len, mode)
        key = (batch, kv_len, mode)
        if key not in self.graphs:
            # Warm-up first (lazy initialisation, kernel compilation), then capture. The warm-up
            # computes this very step, so its cache writes are the ones the replay repeats.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self._step(batch, kv_len, mode)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._step(batch, kv_len, mode)
            self.graphs[key] = (graph, out)
        graph, out = self.graphs[key]
        graph.replay()
        return out
