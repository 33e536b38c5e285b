"""A group leader's small messages to the group's other ranks: through host shared memory where
they all run on one host, through a broadcast elsewhere.

A tensor-parallel engine's leader tells the other ranks what each step is (inference/engine.py:
the operation, the batch, and a decode step's inputs, a few KB) before every step, and they wait
for it on the host: they must know which CUDA graph to replay. As an NCCL broadcast that message
cost the leader's host 114-292 µs a step inside `dist.broadcast` and the followers a device
round trip before their host could read it, while every GPU idled (two H200s, the 48-layer
Qwen3-30B-A3B shape: 0.75-1.45 ms idle between decode steps of ~10.6 ms at batch 64, 0.5-0.65 on
one GPU; docs/benchmarks.md, 2026-11-28, eighth session). vLLM sends its scheduler's output to the
workers of one host through a shared-memory ring for the same reason.

`open_channel` makes one for a group, collectively: the leader creates a POSIX shared-memory
segment (`multiprocessing.shared_memory`) and broadcasts its name once; every other rank maps it;
if any rank cannot (another host), every rank takes `BroadcastChannel` instead. The segment is a
ring of SLOTS messages. The leader writes a message's bytes, its length and CRC-32, then its
sequence number; a follower waits for the number it expects, copies the bytes, checks the CRC
(no fences from Python: a reader on a weakly ordered CPU that saw the number before the bytes
reads again) and acknowledges the number in its own word. The leader reuses a slot only once
every follower has acknowledged what it held. Followers spin for SPIN_S, then sleep in growing
steps up to a millisecond: an idle server's followers use little CPU, a busy one's wake within
microseconds (an engine's follower spins while its GPU runs the last step it enqueued, so the
spin's SPIN_S counts from when its device went idle, a host's turn before the next message). A
follower that hears nothing for `timeout_s` (NCCL's default, 10 minutes; the engine's leader
sends keep-alives while idle) raises instead of hanging.

Counted as one `broadcast` a message (`comm.calls`), as the broadcast it replaces.
"""

from __future__ import annotations

import secrets
import time
import weakref
import zlib
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch
import torch.distributed as dist

from moemesh.parallel import comm

SLOTS = 8
SPIN_S = 0.02  # a follower's busy wait before it sleeps
LONGEST_SLEEP_S = 1e-3
TIMEOUT_S = 600.0
HEADER = 3  # int64 words a slot: sequence number, byte length, CRC-32


class ChannelTimeout(RuntimeError):
    """No message from the leader within the channel's timeout (the leader died or hangs)."""


class SharedMemoryChannel:
    """The ring in shared memory (see the module docstring); `capacity` bytes a message at most."""

    def __init__(self, segment: shared_memory.SharedMemory, capacity: int, rank: int, world: int, owner: bool):
        self.segment, self.capacity, self.rank, self.world = segment, capacity, rank, world
        words = np.ndarray((self.size(capacity, world) // 8,), dtype=np.int64, buffer=segment.buf)
        self.acks = words[:world]  # what each rank has read (the leader's word unused)
        self.slots = words[world:].reshape(SLOTS, HEADER + capacity // 8)
        self.sent = self.received = 0
        self.timeout_s = TIMEOUT_S
        # The leader's segment is gone when its channel closes or is collected, or at exit.
        self._unlink = weakref.finalize(self, _unlink, segment) if owner else None

    @staticmethod
    def size(capacity: int, world: int) -> int:
        return 8 * (world + SLOTS * (HEADER + capacity // 8))

    def send(self, message: np.ndarray) -> None:
        """The leader: `message` (int64, at most capacity bytes) to every other rank."""
        data = message.view(np.int64).ravel()
        number = self.sent + 1
        slot = self.slots[number % SLOTS]
        deadline = None
        while self.world > 1 and int(self.acks[1:].min()) < number - SLOTS:  # a follower is a ring behind
            deadline = deadline or time.monotonic() + self.timeout_s
            if time.monotonic() > deadline:
                raise ChannelTimeout(f"a follower read no message for {self.timeout_s:.0f} s")
            time.sleep(1e-5)
        slot[HEADER : HEADER + data.size] = data
        slot[1], slot[2] = data.size, zlib.crc32(data.tobytes())
        slot[0] = number  # last: what a follower waits for
        self.sent = number
        comm._count("broadcast", "forward", data.nbytes)

    def receive(self, busy: Callable[[], bool] | None = None) -> np.ndarray:
        """A follower: the next message (a copy, int64). While `busy()` is true (the follower's
        device still runs its last step) it spins; SPIN_S after it is not, it sleeps."""
        number = self.received + 1
        slot = self.slots[number % SLOTS]
        start = idle_since = time.monotonic()
        pause = 0.0
        while True:
            if int(slot[0]) == number:  # its bytes copied, then checked: a number seen before them reads again
                data = slot[HEADER : HEADER + int(slot[1])].copy()
                if int(slot[0]) == number and zlib.crc32(data.tobytes()) == int(slot[2]):
                    break
            now = time.monotonic()
            if now - start > self.timeout_s:
                raise ChannelTimeout(f"no message from the group's leader for {self.timeout_s:.0f} s")
            if busy is not None and pause == 0.0 and busy():
                idle_since = now
            if now - idle_since > SPIN_S:
                pause = min(LONGEST_SLEEP_S, max(pause * 2, 1e-5))
                time.sleep(pause)
        self.acks[self.rank] = number
        self.received = number
        comm._count("broadcast", "forward", data.nbytes)
        return data

    def close(self) -> None:
        self.slots = self.acks = None  # the views first: the segment's buffer cannot close under them
        self.segment.close()
        if self._unlink is not None:
            self._unlink()

    __del__ = close


class BroadcastChannel:
    """The same messages by `comm.broadcast_` of a device tensor (ranks on several hosts)."""

    def __init__(self, group, capacity: int, device: torch.device):
        self.group = group
        self.buffer = torch.zeros(capacity // 8 + 1, dtype=torch.int64, device=device)  # [0]: the length

    def send(self, message: np.ndarray) -> None:
        data = torch.from_numpy(message.view(np.int64).ravel())
        self.buffer[0] = data.numel()
        self.buffer[1 : 1 + data.numel()].copy_(data)
        comm.broadcast_(self.buffer, self.group)

    def receive(self, busy: Callable[[], bool] | None = None) -> np.ndarray:
        host = comm.broadcast_(self.buffer, self.group).cpu().numpy()
        return host[1 : 1 + int(host[0])].copy()

    def close(self) -> None:
        pass


# Where False, every group takes BroadcastChannel (tests of that path).
SHARED_MEMORY = True


def open_channel(group, capacity: int, device: torch.device) -> SharedMemoryChannel | BroadcastChannel:
    """A channel from `group`'s first rank to its others for messages of up to `capacity` bytes;
    collective over the group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    leader = dist.get_global_rank(group, 0)
    capacity = -(-capacity // 8) * 8
    name = [None]
    segment = None
    if rank == 0 and SHARED_MEMORY:
        try:
            segment = shared_memory.SharedMemory(  # zeros: no message yet, nothing acknowledged
                create=True, size=SharedMemoryChannel.size(capacity, world), name=f"moemesh_{secrets.token_hex(8)}"
            )
            name = [segment.name]
        except OSError:
            segment = None
    dist.broadcast_object_list(name, src=leader, group=group, device=device)
    if rank != 0 and name[0] is not None:
        try:
            segment = _attach(name[0])
        except OSError:
            segment = None
    everywhere = [None] * world
    dist.all_gather_object(everywhere, segment is not None, group=group)
    if all(everywhere):
        return SharedMemoryChannel(segment, capacity, rank, world, owner=rank == 0)
    if segment is not None:
        segment.close()
        if rank == 0:
            segment.unlink()
    return BroadcastChannel(group, capacity, device)


def _attach(name: str) -> shared_memory.SharedMemory:
    """The leader's segment mapped here, not registered with this process's resource tracker: it
    is the leader's to unlink (Python before 3.13 registers every mapping, and unlinks it when
    this process exits or warns that it leaked)."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python 3.13+
    except TypeError:
        register, resource_tracker.register = resource_tracker.register, lambda *args: None
        try:
            return shared_memory.SharedMemory(name=name)
        finally:
            resource_tracker.register = register


def _unlink(segment: shared_memory.SharedMemory) -> None:
    try:
        segment.unlink()
    except FileNotFoundError:
        pass
