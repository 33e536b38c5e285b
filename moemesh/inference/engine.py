"""The engine: a model, its paged KV cache, and one step that runs any mix of prompt chunks and
decode tokens in one forward and samples the next token of the sequences that want one.

The cache (models/kv_cache.py) is a pool of blocks; the scheduler decides which sequence holds
which blocks (inference/blocks.py) and tells the engine each table row's blocks (`set_blocks`).
A step is a list of `Chunk`s, one per sequence: tokens to compute at the positions that follow
its cached ones, in its table row, and whether the last of them samples the sequence's next
token. Two shapes of step:

  * decode — every chunk one token that samples: the batch [B, 1], B the smallest of a few
    captured sizes (1, 2, 4, ... max_batch) covering the chunks, attention reading each row up to
    its position, at most kv_len entries (a power of two covering the furthest). Padding tokens
    write into the null block through the scratch row. Each (B, kv_len, sampling mode) is a CUDA
    graph, captured at first use (after an eager warm-up on a side stream) and replayed from then
    on: a step is two small host-to-device copies, one replay and one read of the B tokens.
  * packed — anything else: the chunks' tokens one after the other in a batch [1, N] (varlen),
    each chunk attending causally to its own sequence's cache, its own new keys included (chunked
    prefill beside decodes: the scheduler's token budget bounds N; the MoE block takes the
    grouped GEMM path of training). Up to `packed_graph_tokens` tokens the step is padded to the
    next bucket size (16, 24, 32, 48, ... 192, 256, then every PACKED_BUCKET_STEP tokens), its tokens,
    positions, rows and samples copied into fixed buffers, and each (bucket, sampling mode) is a
    CUDA graph as the decode steps are — the attention's tiles are found on the device, so one
    graph serves every mix of chunks. Eagerly a 48-layer packed step launches ~900 kernels from
    Python (~50 ms of host time for ~10 ms of GPU work at 64 tokens), which bounded the
    time-to-first-token of every request the server admitted while others decode. Padding
    tokens sit at position 0 of the scratch row, each its own run; they are not free: all alike,
    they all choose the same experts and cost the MoE as much as a prompt's tokens, so above 256
    the buckets are PACKED_BUCKET_STEP apart, not half their size (on an H200 a loaded server's
    step of 60 decode tokens and 3 prompts of 512 took 46.7 ms padded to 1,664 tokens against
    52.1 padded to 2,048; docs/benchmarks.md). A bucket samples
    min(bucket, max_batch) rows, those past the step's at its first token. Larger steps, steps
    that keep all the logits of a chunk, and models whose attention needs the runs on the host
    (the eager reference: DeepSeek's latent attention) run eagerly.

Pool size: `num_blocks` as given; else on a GPU from memory — one forward of the largest step
(max_num_batched_tokens tokens, into the scratch row) measures the activations' peak, and the
cache takes what is left of gpu_memory_fraction of the device after the weights and that peak;
on a CPU max_batch rows of max_len entries (the static cache's capacity).

With `batch_invariant` every step runs in batch-invariant mode (`ops/invariant.py`): a sequence's
tokens and log-probabilities are then the same bits whatever else its steps hold, and equal to the
trainer's forward in that mode. Its steps are CUDA graphs on a GPU as the default's are (on an
H200 with the 48-layer Qwen3-30B-A3B shape, docs/benchmarks.md: eager, the host's launches made a
step 5-26× the default's); `cuda_graphs=False` runs them eagerly, as recording the routing needs.

`step` returns the tokens; `launch` returns them on their way (`Launched`: copied to pinned host
memory behind the step), so that the scheduler launches the next step before it reads them. Every
step writes each sampling row's token into `sampled` (per table row), and a chunk's token
PREVIOUS is read from there on the device: the next decode step needs no token from the host.

A step keeps the logits it sampled from (`last_logits`: [sampling chunks, V], read before the
next step), so that requests with penalties, biases, grammars or log-probabilities can be
processed after it (processing.py); a chunk with `all_logits` keeps those of every token too
(`last_all_logits`: a prompt's own log-probabilities).

Under tensor parallelism (or expert parallelism for decoding: `parallel.expert.apply_ep_for_decoding`)
every rank holds an engine over its shard; the rank that schedules
(rank 0 of the group) sends each step's operation, inputs and block-table changes first, and the
others, in `follow`, run the same calls — collectives inside the model then pair up, and every
rank samples the same tokens from the same gathered logits. A decode step is one message (the
operation and the step's inputs, fixed-size) through `parallel/channel.py`, host shared memory
where the ranks share a host, and the graphs read the inputs where the message lands on the
device (views of it): against an NCCL broadcast of a message built from torch tensors and copied
into the graphs' buffers, two H200s' GPUs idle 0.2-0.9 ms less between decode steps
(docs/benchmarks.md, 2026-11-28, eighth session). On GPUs the model's all-reduces
of up to a packed step's activations go through a buffer every rank maps
(`comm.use_peer_all_reduce`) rather than NCCL: a decode step's are a few KB each, two a layer, and
their latency is what tensor parallelism adds to a step (docs/benchmarks.md, issue 49).
"""

from __future__ import annotations

import contextlib
import gc
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from moemesh.inference.blocks import BlockPool
from moemesh.inference.request import Sampling
from moemesh.inference.sampling import MODES, mode_for, sample
from moemesh.models import MoECausalLM, PagedKVCache
from moemesh.models.kv_cache import HostLayoutMissing
from moemesh.models.weights import copy_weights
from moemesh.ops import backend, invariant
from moemesh.ops.quantized_weight import QuantizedWeight
from moemesh.parallel import comm
from moemesh.parallel.channel import open_channel

_FORWARD, _DECODE, _STOP, _KEEP_ALIVE, _TABLES = 1, 2, 3, 4, 5
# A chunk's token that is the one its row's last step sampled: still on the device, not yet read
# (the scheduler's next step launched before the host has this one's tokens).
PREVIOUS = -1
# Packed-step buckets above 256 tokens are this far apart (the module doc says why).
PACKED_BUCKET_STEP = 128


@dataclass(frozen=True)
class Chunk:
    """One sequence's part of a step: `tokens` at positions start, start + 1, ... of the sequence
    in table row `row`; with `sample`, the last one's logits choose the sequence's next token
    (its `step`-th: the sampling noise's counter)."""

    row: int
    tokens: list[int]
    start: int
    sample: bool = True
    step: int = 0
    sampling: Sampling = Sampling()
    all_logits: bool = False  # keep the logits of every token (a prompt's own log-probabilities)


class Launched:
    """A step on its way: its sampled tokens are copied to the host behind it (`tokens()` waits for
    that copy alone), its logits are those it sampled from, and those kept of every token of the
    chunks that asked (by chunk index). The logits of a decode step or a packed bucket are the
    captured graph's buffers: the next step of the same shape overwrites them."""

    def __init__(self, host: torch.Tensor, event, logits: torch.Tensor, all_logits: dict[int, torch.Tensor]):
        self.host, self.event, self.logits, self.all_logits = host, event, logits, all_logits

    def done(self) -> bool:
        """Whether its tokens are on the host (`tokens()` would not wait)."""
        return self.event is None or self.event.query()

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class DecodeEngine:
    def __init__(
        self,
        model: MoECausalLM,
        max_batch: int = 16,
        max_len: int | None = None,
        cuda_graphs: bool | None = None,
        max_num_batched_tokens: int = 8192,
        packed_graph_tokens: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_fraction: float = 0.9,
        prefix_caching: bool = True,
        group=None,
        batch_invariant: bool = False,
    ):
        self.model = model
        # Each sequence's numbers independent of the rest of its step (ops/invariant.py); its
        # kernels need no host sync, so its steps are captured too.
        self.batch_invariant = batch_invariant
        if batch_invariant and any(isinstance(w, QuantizedWeight) for m in model.modules() for w in vars(m).values()):
            raise ValueError(
                "batch-invariant mode does not cover quantized weights yet: load the model dense (--dequantize)"
            )
        self.device = next(model.parameters()).device
        if batch_invariant and cuda_graphs and self.device.type != "cuda":
            raise ValueError("batch-invariant mode's CPU reference runs eagerly (no CUDA graphs)")
        limit = model.config.max_position_embeddings
        self.max_len = min(max_len or limit, limit)
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        if max_batch < 1 or max_num_batched_tokens < 1 or block_size < 1 or not 0 < gpu_memory_fraction <= 1:
            raise ValueError(
                f"max_batch, max_num_batched_tokens and block_size must be >= 1 and gpu_memory_fraction in (0, 1]; "
                f"got {max_batch}, {max_num_batched_tokens}, {block_size}, {gpu_memory_fraction}"
            )
        self.batch_sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
        # 64, 128, ... up to max_len: attention reads at most twice the entries in use
        self.kv_lens = sorted(
            {min(1 << i, self.max_len) for i in range(6, self.max_len.bit_length() + 1)} | {self.max_len}
        )
        self.block_size = block_size
        self.group = group
        self.leader = group is None or dist.get_rank(group) == 0
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor], comm.Issued]] = {}
        self._pool = None
        # Packed steps padded to a bucket (captured when cuda_graphs): 16, 24, ... 256, 384, 512, ...
        if packed_graph_tokens is None:
            packed_graph_tokens = min(2048, max_num_batched_tokens) if self.cuda_graphs else 0
        sizes = {size for i in range(4, 8) for size in (1 << i, 3 << (i - 1))}  # 16, 24, ... 128, 192
        sizes |= set(range(256, packed_graph_tokens, PACKED_BUCKET_STEP)) | {packed_graph_tokens}
        self.packed_buckets = sorted(s for s in sizes if 16 <= s <= min(packed_graph_tokens, max_num_batched_tokens))
        largest = self.packed_buckets[-1] if self.packed_buckets else 0
        # A bucket's inputs: per token (token, position, table row); per sampling row (token
        # index, seed, step, table row) and (temperature, top_p).
        self.packed_ints = torch.zeros(largest, 3, dtype=torch.long, device=self.device)
        self.packed_samples = torch.zeros(min(largest, max_batch), 4, dtype=torch.long, device=self.device)
        self.packed_floats = torch.zeros(min(largest, max_batch), 2, dtype=torch.float32, device=self.device)
        # What a padding token and a padding sampling row hold: token 0 at position 0 of the
        # cache's scratch row (its row max_batch), greedy, its token written to the scratch row.
        self._padding = (
            torch.tensor([0, 0, max_batch], device=self.device),
            torch.tensor([0.0, 1.0], device=self.device),
            torch.tensor([0, 0, 0, max_batch], device=self.device),
        )
        # The token each table row's last step sampled (the scratch row's: padding), which a
        # chunk's PREVIOUS stands for.
        self.sampled = torch.zeros(max_batch + 1, dtype=torch.long, device=self.device)
        # What the leader of a tensor-parallel group sends first: (operation, a, b, c), then for a
        # decode step its inputs, where its captured graphs read them (views of the message, so
        # that its copy to the device delivers them with no copy after it): per token (token, position,
        # table row, seed, step), and (temperature, top_p) as float32 pairs in int64 slots.
        self.message = torch.zeros(4 + 6 * max_batch, dtype=torch.long, device=self.device)
        self.ints = self.message[4 : 4 + 5 * max_batch].view(max_batch, 5)
        self.floats = self.message[4 + 5 * max_batch :].view(torch.float32).view(max_batch, 2)
        # ... written on the host into pinned memory, then sent in one asynchronous copy (the
        # event: that copy, which the next one waits for before the host writes again).
        on_gpu = self.device.type == "cuda"
        self._staging = torch.zeros_like(self.message, device="cpu", pin_memory=on_gpu) if on_gpu else self.message
        self._staged = torch.cuda.Event() if on_gpu else None
        # Each step's sampled tokens come back into pinned memory, two in turn: the scheduler
        # reads a step's after it has launched the next (`launch`).
        self._returns = (
            [(torch.zeros(max_batch, dtype=torch.long, pin_memory=True), torch.cuda.Event()) for _ in range(2)]
            if on_gpu
            else []
        )
        # The leader's messages to the group's other ranks (host shared memory on one host).
        self.channel = None if group is None else open_channel(group, 8 * self.message.numel(), self.device)
        if group is not None:
            hidden_bytes = model.config.hidden_size * next(model.parameters()).element_size()
            comm.use_peer_all_reduce(
                group, self.device, next(model.parameters()).dtype, max_num_batched_tokens * hidden_bytes
            )
        self.vocab = model.config.vocab_size
        # The logits of the last step: [S, V] those each sampling chunk sampled from, in order, and
        # chunk index -> [tokens, V] for the chunks that asked for all of theirs.
        self.last_logits: torch.Tensor | None = None
        self.last_all_logits: dict[int, torch.Tensor] = {}
        self.memory_note = ""  # on a GPU, where its memory went when the pool was sized
        if num_blocks is None:
            num_blocks = self._blocks_from_memory(gpu_memory_fraction)
        self.cache = PagedKVCache(num_blocks, block_size, max_batch, self.max_len, self.device)
        if (num_blocks - 1) * block_size < self.max_len:
            raise ValueError(
                f"the KV cache holds {(num_blocks - 1) * block_size} tokens ({num_blocks - 1} blocks of "
                f"{block_size}), fewer than one sequence of max_len={self.max_len}{self.memory_note}"
            )
        self.tables = torch.zeros_like(self.cache.block_tables, device="cpu")  # the host's copy
        self._changed: set[int] = set()
        self.blocks = BlockPool(num_blocks, block_size, prefix_caching)

    @property
    def capacity(self) -> int:
        """Tokens the cache holds (the null block aside)."""
        return (self.cache.num_blocks - 1) * self.block_size

    # ---- the operations ---------------------------------------------------------------------------
    def set_blocks(self, row: int, blocks: list[int]) -> None:
        """Table row `row` holds these blocks (its sequence's entries 0, block_size, ... in order);
        sent to the device with the next step."""
        if len(blocks) > self.tables.shape[1]:
            raise ValueError(f"{len(blocks)} blocks for row {row}: a row holds {self.tables.shape[1]}")
        self.tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.tables[row, len(blocks) :] = 0
        self._changed.add(row)

    def step(self, chunks: list[Chunk]) -> list[int]:
        """One forward of the chunks; the next token of each chunk that samples, in order (their
        logits in `last_logits`, and those of the chunks with `all_logits` in `last_all_logits`)."""
        return self.launch(chunks).tokens()

    @torch.no_grad()
    def launch(self, chunks: list[Chunk]) -> Launched:
        """`step` without waiting for it: the host may prepare and launch the next step while the
        device runs this one, and read this one's tokens after (the scheduler does). A chunk's
        token may be PREVIOUS, the token its row's last step sampled, not yet read."""
        self.last_all_logits = {}
        if not chunks:
            return Launched(torch.zeros(0, dtype=torch.long), None, torch.zeros(0, self.vocab), {})
        end = max(c.start + len(c.tokens) for c in chunks)
        if end > self.max_len:
            raise ValueError(f"position {end - 1} is beyond the cache's rows of {self.max_len} entries")
        self._send_tables()
        with self._arithmetic():
            if len(chunks) <= self.max_batch and all(
                len(c.tokens) == 1 and c.sample and not c.all_logits for c in chunks
            ):
                tokens = self._decode_step(chunks, end)
            else:
                tokens = self._packed_step(chunks)
        return Launched(*self._tokens_back(tokens), self.last_logits, self.last_all_logits)

    def _tokens_back(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The step's tokens copied to pinned host memory behind it, and the event of that copy
        (on a CPU the tokens themselves; more than max_batch: copied at once)."""
        if not self._returns or len(tokens) > self.max_batch:
            return tokens.cpu(), None
        self._returns.reverse()
        host, event = self._returns[0]
        event.synchronize()  # the step before last's tokens have left this buffer
        host = host[: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        event.record()
        return host, event

    @torch.no_grad()
    def warm_up(self) -> float:
        """One greedy decode step at every batch size, one packed step of the largest size and
        one at every bucket size, while no sequence runs (padding into the null block
        only), so that the kernels are compiled, their tiles tuned and the graphs captured
        (seconds on a GPU) before the first requests rather than inside them. Returns the
        seconds it took."""
        start = time.perf_counter()
        # In the engine's mode: the graphs captured here are those its steps replay.
        with self._arithmetic():
            # The largest packed step first (eager when it is larger than every bucket); the
            # cache's pools are allocated at its first write.
            tokens = min(self.max_num_batched_tokens, self.max_len)
            self._packed_step([Chunk(self.cache.scratch_row, [0] * tokens, 0, True)])
            for bucket in self.packed_buckets:  # runs of at most max_len tokens of the scratch row, sampling nothing
                pieces = [min(self.max_len, bucket - first) for first in range(0, bucket, self.max_len)]
                self._packed_step([Chunk(self.cache.scratch_row, [0] * n, 0, sample=False) for n in pieces])
            kv_len = self.kv_lens[0]
            for batch in self.batch_sizes:  # padding: token 0 at position 0 of the scratch row, greedy
                row = [0, 0, self.cache.scratch_row, 0, 0]
                self._send_decode([row] * batch, [[0.0, 1.0]] * batch, kv_len, "greedy")
                self._run(batch, kv_len, "greedy")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def load_weights(self, source) -> int:
        """New weights in place, from a model (LoRA adapters merged) or a state dict of the same
        layout (`models/weights.py`; under tensor parallelism every rank its own shard), between
        generations: RuntimeError while sequences hold blocks, ValueError when names or shapes do
        not fit, either before anything changes. The prefix cache is emptied (its blocks hold keys
        and values of the old weights); captured CUDA graphs stay valid (same tensors). Returns the
        tensors copied. From another process: `models/weights.receive_weights(connection, engine.load_weights)`."""
        self.blocks.reset_prefix_cache()
        return copy_weights(self.model, source)

    def keep_alive(self) -> None:
        """Tell the followers the leader is alive though idle: their wait for the next step
        would otherwise hit the process group's timeout."""
        self._announce(_KEEP_ALIVE)

    def close(self) -> None:
        """Release the followers of a tensor-parallel group (the leader calls it once, at the end)."""
        self._announce(_STOP)

    def follow(self) -> None:
        """On a tensor-parallel rank other than the leader: run what the leader announces, until it closes."""
        # Its host runs ahead of its device as the leader's does (the next step enqueued while this
        # one runs); it spins for the next message while its device is busy.
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        busy = None if stream is None else lambda: not stream.query()
        while True:
            message = self.channel.receive(busy)
            op, a, b, c = (int(v) for v in message[:4])
            if op == _STOP:
                return
            if op == _KEEP_ALIVE:
                continue
            with torch.no_grad(), self._arithmetic():
                if op == _TABLES:
                    rows = comm.broadcast_(torch.empty(a, dtype=torch.long, device=self.device), self.group)
                    tables = torch.empty(a, self.tables.shape[1], dtype=torch.int32, device=self.device)
                    self.cache.block_tables[rows] = comm.broadcast_(tables, self.group)
                elif op == _FORWARD:
                    ints = comm.broadcast_(torch.empty(a, 4, dtype=torch.long, device=self.device), self.group)
                    samples = comm.broadcast_(torch.empty(b, 4, dtype=torch.long, device=self.device), self.group)
                    floats = comm.broadcast_(torch.empty(b, 2, dtype=torch.float32, device=self.device), self.group)
                    # the rows' runs only for an eager step, read back then: a bucket's replay needs no host
                    # view of its inputs, and reading one would wait for the step in flight
                    self._forward(ints, samples, floats, None, MODES[c % len(MODES)], c >= len(MODES))
                else:  # a decode step: its inputs came with the message
                    self._staging_for_write()[:] = message
                    self._copy_staged()
                    self._run(a, b, MODES[c])

    # ---- inside ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _arithmetic(self):
        """How the engine's forwards compute: in its batch-invariant mode or not, and under a group
        with the tuned kernels' tiles every rank agrees on (`backend.agreed_tiles`)."""
        with invariant.batch_invariant(self.batch_invariant), backend.agreed_tiles(self.group):
            yield

    def _announce(self, op: int, a: int = 0, b: int = 0, c: int = 0, *tensors: torch.Tensor) -> None:
        if self.group is None:
            return
        self.channel.send(np.array([op, a, b, c], dtype=np.int64))
        for t in tensors:
            comm.broadcast_(t, self.group)

    def _send_decode(self, ints: list[list[int]], floats: list[list[float]], kv_len: int, mode: str) -> None:
        """A decode step's inputs, per row (token, position, table row, seed, step) and
        (temperature, top_p), into the buffers its graphs read: written into pinned host memory,
        then one asynchronous copy, and on the leader of a tensor-parallel group one message
        through the channel. While the host builds it the GPU idles: as torch.tensor of lists and
        three copies it took an H200 host 119 µs at batch 1 and 235 at 64, now 58 and 114 (one
        call; docs/benchmarks.md, 2026-11-28, eighth session)."""
        batch, floats_at = len(ints), 4 + 5 * self.max_batch
        staged = self._staging_for_write()
        staged[:4] = (_DECODE, batch, kv_len, MODES.index(mode))
        staged[4 : 4 + 5 * batch] = np.asarray(ints, dtype=np.int64).ravel()
        staged[floats_at : floats_at + batch] = np.asarray(floats, dtype=np.float32).view(np.int64).ravel()
        if self.channel is not None:
            self.channel.send(staged)
        self._copy_staged()

    def _staging_for_write(self) -> np.ndarray:
        """The host memory of the next step's message, once the previous one's copy has left it."""
        if self._staged is not None:
            self._staged.synchronize()
        return self._staging.numpy()

    def _copy_staged(self) -> None:
        """The staged message to the device (asynchronously); on a CPU it is the message itself."""
        if self._staged is not None:
            self.message.copy_(self._staging, non_blocking=True)
            self._staged.record()

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device without the host waiting: PyTorch makes a copy from pageable
        memory wait for the stream, i.e. for the step in flight, which undid the scheduler's overlap
        in every round that sent a block table or packed a prompt. Through pinned memory the copy is
        asynchronous (the caching host allocator keeps the buffer until the copy has run)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def _send_tables(self) -> None:
        if not self._changed:
            return
        rows = torch.tensor(sorted(self._changed), dtype=torch.long)
        tables = self._to_device(self.tables[rows])
        rows = self._to_device(rows)
        self._announce(_TABLES, len(rows), 0, 0, rows, tables)
        self.cache.block_tables[rows] = tables
        self._changed.clear()

    def _decode_step(self, chunks: list[Chunk], end: int) -> torch.Tensor:
        batch = next(b for b in self.batch_sizes if b >= len(chunks))
        kv_len = next(n for n in self.kv_lens if n >= end)
        mode = mode_for([c.sampling.temperature for c in chunks], [c.sampling.top_p for c in chunks])
        ints = [[c.tokens[0], c.start, c.row, c.sampling.seed, c.step] for c in chunks]
        ints += [[0, 0, self.cache.scratch_row, 0, 0]] * (batch - len(chunks))
        floats = [[c.sampling.temperature, c.sampling.top_p] for c in chunks] + [[0.0, 1.0]] * (batch - len(chunks))
        self._send_decode(ints, floats, kv_len, mode)
        tokens, logits = self._run(batch, kv_len, mode)
        self.last_logits = logits[: len(chunks)]
        return tokens[: len(chunks)]

    def _packed_step(self, chunks: list[Chunk]) -> torch.Tensor:
        ints, samples, floats = [], [], []
        for c in chunks:
            if c.sample:
                samples.append([len(ints) + len(c.tokens) - 1, c.sampling.seed, c.step, c.row])
                floats.append([c.sampling.temperature, c.sampling.top_p])
            ints += [[token, c.start + i, c.row, c.all_logits] for i, token in enumerate(c.tokens)]
        sampled = [c for c in chunks if c.sample]
        mode = mode_for([c.sampling.temperature for c in sampled], [c.sampling.top_p for c in sampled])
        host, flagged = ints, any(c.all_logits for c in chunks)
        ints = self._to_device(torch.tensor(ints, dtype=torch.long))
        samples = self._to_device(torch.tensor(samples, dtype=torch.long).view(-1, 4))
        floats = self._to_device(torch.tensor(floats, dtype=torch.float32).view(-1, 2))
        code = MODES.index(mode) + len(MODES) * flagged  # the mode, and whether any token wants its logits
        self._announce(_FORWARD, len(ints), len(samples), code, ints, samples, floats)
        tokens, self.last_logits, rest = self._forward(ints, samples, floats, host, mode, flagged)
        for i, c in enumerate(chunks):
            if c.all_logits:
                self.last_all_logits[i], rest = rest[: len(c.tokens)], rest[len(c.tokens) :]
        return tokens

    def packed_bucket(self, tokens: int) -> int | None:
        """The bucket a packed step of `tokens` tokens is padded to: the smallest that holds it
        (None: larger than every bucket, or none captured; the step runs eagerly)."""
        return next((b for b in self.packed_buckets if b >= tokens), None)

    def _forward(
        self, ints, samples, floats, host: list[list[int]] | None, mode: str, flagged: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed step: ints [N, 4] (token, position, table row, all logits wanted), samples
        [S, 4] (token index, seed, step, table row) and floats [S, 2] (temperature, top_p); `host`
        the ints as lists where the caller has them (else read back if the step runs eagerly);
        `flagged` whether any token wants all its logits. Returns the S sampled tokens, their logits
        [S, V], and the logits of the tokens flagged [F, V]. In a bucket when one takes it."""
        count = len(samples)
        bucket = self.packed_bucket(len(ints))
        if bucket is not None and not flagged:
            rows = self._fill_bucket(ints, samples, floats, bucket)
            try:
                tokens, logits = self._replay(("packed", bucket, mode), lambda: self._bucket_step(bucket, rows, mode))
                return tokens[:count], logits[:count], logits[:0]
            except HostLayoutMissing:  # this model's attention reads the runs on the host: eager from now on
                self.packed_buckets = []
        return self._eager_forward(ints, samples, floats, host, mode)

    def _eager_forward(self, ints, samples, floats, host, mode: str) -> tuple[torch.Tensor, ...]:
        count = len(samples)
        segments = _segments(ints.tolist() if host is None else host)
        self.cache.set_step(ints[:, 2], ints[:, 1], max(s[3] for s in segments), segments)
        if not count:  # only chunks of prompts that go on: the last token stands in (never read)
            samples, floats = ints.new_tensor([[len(ints) - 1, 0, 0, self.max_batch]]), floats.new_tensor([[0.0, 1.0]])
            mode = "greedy"
        at = torch.cat([samples[:, 0], ints[:, 3].nonzero()[:, 0]])
        tokens = self._fed(ints[:, 0], ints[:, 2])
        logits = self.model.next_token_logits(tokens[None], self.cache, ints[None, :, 1], at=at)
        sampled, flagged_logits = logits[: len(samples)], logits[len(samples) :]
        tokens = self._sampled(sampled, floats, samples[:, 1], samples[:, 2], samples[:, 3], mode)
        return tokens[:count], sampled[:count], flagged_logits

    def _fed(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The step's tokens, each PREVIOUS as its row's last sampled token."""
        return torch.where(tokens == PREVIOUS, self.sampled[rows], tokens)

    def _sampled(self, logits, floats, seeds, steps, rows, mode: str) -> torch.Tensor:
        """Tokens sampled from the logits, per row (temperature, top_p) in floats, its seed and
        step, each written as its table row's last sampled token."""
        tokens = sample(logits, floats[:, 0], floats[:, 1], seeds, steps, mode)
        self.sampled[rows] = tokens
        return tokens

    def _fill_bucket(self, ints, samples, floats, bucket: int) -> int:
        """The step's inputs into the fixed buffers, padded to `bucket` tokens; returns the
        bucket's sampling rows."""
        rows, count = min(bucket, self.max_batch), len(samples)
        self.packed_ints[: len(ints)] = ints[:, :3]
        self.packed_ints[len(ints) : bucket] = self._padding[0]
        self.packed_samples[:count] = samples
        self.packed_samples[count:rows] = self._padding[2]
        self.packed_floats[:count] = floats
        self.packed_floats[count:rows] = self._padding[1]
        return rows

    def _bucket_step(self, bucket: int, rows: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step of `bucket` tokens from the fixed buffers, laid out without host runs:
        (the `rows` sampled tokens, their logits)."""
        ints, samples, floats = self.packed_ints[:bucket], self.packed_samples[:rows], self.packed_floats[:rows]
        self.cache.set_step(ints[:, 2], ints[:, 1], self.max_len, packed=True)
        tokens = self._fed(ints[:, 0], ints[:, 2])
        logits = self.model.next_token_logits(tokens[None], self.cache, ints[None, :, 1], at=samples[:, 0])
        return self._sampled(logits, floats, samples[:, 1], samples[:, 2], samples[:, 3], mode), logits

    def _step(self, batch: int, kv_len: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the tokens, the logits they were sampled from)."""
        ints, floats = self.ints[:batch], self.floats[:batch]
        self.cache.set_step(ints[:, 2], ints[:, 1], kv_len)
        tokens = self._fed(ints[:, 0], ints[:, 2])
        logits = self.model.next_token_logits(tokens[:, None], self.cache, ints[:, 1:2])
        return self._sampled(logits, floats, ints[:, 3], ints[:, 4], ints[:, 2], mode), logits

    def _run(self, batch: int, kv_len: int, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._replay((batch, kv_len, mode), lambda: self._step(batch, kv_len, mode))

    def _replay(self, key: tuple, step) -> tuple[torch.Tensor, torch.Tensor]:
        """`step()` (a forward from the fixed input buffers), as the CUDA graph of `key`: captured
        at first use, replayed from then on. Without CUDA graphs, `step()` itself."""
        if not self.cuda_graphs:
            return step()
        if key not in self.graphs:
            # Warm-up first (lazy initialisation, kernel compilation), then capture. The warm-up
            # computes this very step, so its cache writes are the ones the replay repeats.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out, issued = comm.counted_apart(step)
            self.graphs[key] = (graph, out, issued)
        graph, out, issued = self.graphs[key]
        graph.replay()
        comm.recount(issued)  # the collectives the replay ran, counted as an eager step counts them
        return out

    def _blocks_from_memory(self, fraction: float) -> int:
        """CPU: max_batch rows of max_len entries. GPU: a provisional cache of the null block and one
        more, one forward of the largest step into the scratch row (its activations' peak) and,
        with CUDA graphs, one of the largest bucket (the graphs' pool keeps that much apart),
        then the blocks that fit in `fraction` of the device after the weights and those peaks
        (the fewest over a tensor-parallel group)."""
        per_row = math.ceil(self.max_len / self.block_size)
        if self.device.type != "cuda":
            return 1 + self.max_batch * per_row
        self.cache = PagedKVCache(2, self.block_size, self.max_batch, self.max_len, self.device)
        torch.cuda.synchronize(self.device)
        gc.collect()  # a dropped engine's cycles (its graphs, a wrapped method) would still hold its pool
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        # the step's tokens as sequences of at most max_len in the scratch row
        ints = [[0, i % self.max_len, self.cache.scratch_row, 0] for i in range(self.max_num_batched_tokens)]
        ints_on_device = torch.tensor(ints, device=self.device)
        samples = self._padding[2][None]
        floats = torch.tensor([[0.0, 1.0]], device=self.device)
        with torch.no_grad(), backend.agreed_tiles(self.group):
            self._eager_forward(ints_on_device, samples, floats, ints, "greedy")
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        if self.cuda_graphs and self.packed_buckets:
            bucket = self.packed_buckets[-1]
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            rows = self._fill_bucket(ints_on_device[:0], samples[:0], floats[:0], bucket)
            try:
                with torch.no_grad(), backend.agreed_tiles(self.group):
                    self._bucket_step(bucket, rows, "greedy")
                torch.cuda.synchronize(self.device)
                peak += torch.cuda.max_memory_allocated(self.device) - before
            except HostLayoutMissing:
                self.packed_buckets = []
        per_block = self.cache.bytes_per_block()
        del self.cache
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        spare = fraction * total - (total - free) - peak
        self.memory_note = (
            f" (of {fraction:.0%} of {total / 2**30:.1f} GiB: {(total - free) / 2**30:.1f} GiB in use, of which "
            f"{torch.cuda.memory_reserved(self.device) / 2**30:.1f} GiB by this process's tensors, the weights "
            f"among them; {peak / 2**30:.1f} GiB for the largest step's activations)"
        )
        blocks = torch.tensor([max(2, int(spare // per_block))], device=self.device)
        if self.group is not None:  # every rank the same pool: the smallest
            blocks = -comm.all_reduce_max(-blocks, self.group)
        return int(blocks)


def _segments(ints: list[list[int]]) -> list[tuple[int, int, int, int]]:
    """The runs of consecutive tokens of one table row in a packed step's (token, position, row,
    flag) list: (row, first token, tokens, last position + 1)."""
    segments = []
    for i, (_, position, row, _) in enumerate(ints):
        if segments and segments[-1][0] == row and position == segments[-1][3]:  # the run goes on
            first = segments[-1][1]
            segments[-1] = (row, first, i - first + 1, position + 1)
        else:
            segments.append((row, i, 1, position + 1))
    return segments
