"""Weights copied into a model in place, tensor by tensor: how a training run hands its current
weights to an inference engine without writing a checkpoint (`DecodeEngine.load_weights`;
reinforcement learning's sample-train loop, examples/grpo.py) — in the same process
(`copy_weights`), or to an engine in another process of the same machine (`send_weights` in the
trainer's, `receive_weights` in the engine's).

In place: the model keeps its parameter tensors, so whatever holds them (a CUDA graph captured
over them, a tied embedding and LM head) sees the new values. Each copy casts to the target's
dtype and device (an fp32 trainer into a bf16 engine), and nothing is copied unless every name
and shape fits. The layouts must cut the same slices: under tensor or expert parallelism each rank
copies its own shard, of the same local shape, into its own engine — no collective
(tests/test_train_logprobs.py); across processes, over one connection per pair of colocated ranks.
An FSDP-sharded source (DTensor shards) must be gathered first; this refuses it rather than
copying a shard as a whole.

Across processes the state dict goes over a `multiprocessing` connection (a `Pipe` end) without a
copy on the way: with the reductions that `torch.multiprocessing` gives multiprocessing's pickler,
a CUDA tensor travels as a CUDA IPC handle to its memory, which the receiver maps and copies from,
GPU to GPU. So the sender's tensors must stay alive, and unchanged, until the receiver has copied
them: `send_weights` waits for the reply, which comes once every copy has finished on the device.
CPU tensors go packed into one shared-memory buffer (one copy more): shared one by one (torch's
`file_descriptor` strategy), each would be moved into shared memory for good, hold a file
descriptor in either process — two in the sender until fetched, so some 500 tensors (Qwen3-30B-A3B
has 531) pass the usual limit of 1024 — and be fetched over a socket connection of its own.
Limits: one machine (for CUDA, the same GPU or one it can map); the two processes related through
`multiprocessing` (one started the other, or both come from one parent): a shared buffer's file
descriptor is fetched from the sender over a socket authenticated with the key that
`multiprocessing` hands down; /dev/shm must hold the CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # gives multiprocessing the reductions: CUDA IPC handles, shared memory
from torch import nn
from torch.distributed.tensor import DTensor

from moemesh.models.lora import merged_state_dict

Source = nn.Module | Mapping[str, torch.Tensor]
ALIGN = 64  # bytes: each CPU tensor's place in the packed buffer starts at a multiple of this


def copy_weights(model: nn.Module, source: Source) -> int:
    """Copy `source` — a model (LoRA adapters merged on the way, the source left as it is) or a
    state dict — into `model`'s parameters and buffers, in place. ValueError naming the first
    names and shapes that do not fit, before anything is copied. Returns the tensors copied."""
    state = _state_of(source)
    target = model.state_dict()
    missing, unexpected = sorted(set(target) - set(state)), sorted(set(state) - set(target))
    shapes = [
        f"{n} {tuple(state[n].shape)} into {tuple(t.shape)}"
        for n, t in target.items()
        if n in state and state[n].shape != t.shape
    ]
    problems = [
        f"{len(names)} {what} ({_first(names)})"
        for what, names in [
            ("missing", missing),
            ("unexpected", unexpected),
            ("of another shape", shapes),
            ("FSDP-sharded (gather them first)", _sharded(state)),
        ]
        if names
    ]
    if problems:
        raise ValueError("weights do not fit the model: " + ", ".join(problems) + "; nothing copied")
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(state[name])
    return len(target)


def send_weights(connection: Connection, source: Source, timeout: float | None = None) -> int:
    """Hand `source` (as `copy_weights` takes it) to `receive_weights` in another process of this
    machine, over `connection`, and wait for its reply: returns the tensors it copied. The tensors
    stay alive (and must stay unchanged) until the reply. ValueError with the receiver's message if
    it failed (names or shapes that do not fit, say: nothing copied); an FSDP-sharded source is
    refused before anything is sent. TimeoutError after `timeout` seconds without a reply (the
    receiver may still be copying), ConnectionError if it closed the connection."""
    state = _state_of(source)
    if sharded := _sharded(state):
        raise ValueError(f"{len(sharded)} FSDP-sharded tensors ({_first(sharded)}): gather them first; nothing sent")
    buffer, layout = _pack({name: t for name, t in state.items() if t.device.type == "cpu"})
    connection.send(({name: t.detach() for name, t in state.items() if t.device.type != "cpu"}, buffer, layout))
    reply = ForkingPickler.loads(_wait(connection, timeout, "its reply"))
    if isinstance(reply, str):
        raise ValueError(f"the receiving process took no weights: {reply}")
    return reply


def receive_weights(
    connection: Connection, load: Callable[[dict[str, torch.Tensor]], int], timeout: float | None = None
) -> int:
    """Take the state dict that `send_weights` sends over `connection` and `load` it (e.g.
    `engine.load_weights`, or `lambda state: copy_weights(model, state)`: it returns the tensors
    copied); once every copy has finished on the device, and the received tensors are let go, tell
    the sender the count — or its error, then raised here too. TimeoutError after `timeout` seconds
    without weights, ConnectionError if the sender closed the connection."""
    message = _wait(connection, timeout, "the weights")
    try:
        state, buffer, layout = ForkingPickler.loads(message)
        state.update({name: _view(buffer, *where) for name, where in layout.items()})
        count = load(state)
        for device in {t.device for t in state.values() if t.is_cuda}:
            torch.cuda.synchronize(device)  # the sender may change its tensors as soon as it hears back
    except Exception as error:
        connection.send(f"{type(error).__name__}: {error}")
        raise
    finally:
        state = buffer = message = None  # unmaps the sender's memory
    connection.send(count)
    return count


def _state_of(source: Source) -> dict[str, torch.Tensor]:
    return merged_state_dict(source) if isinstance(source, nn.Module) else dict(source)


def _sharded(state: Mapping[str, torch.Tensor]) -> list[str]:
    return [name for name, t in state.items() if isinstance(t, DTensor)]


def _first(names: list[str]) -> str:
    return "; ".join(names[:3]) + ("; ..." if len(names) > 3 else "")


def _pack(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, dict]:
    """CPU tensors copied into one shared-memory buffer, and where each lies in it."""
    layout, size = {}, 0
    for name, t in tensors.items():
        layout[name] = (size, t.dtype, t.shape)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    if not layout:
        return None, layout
    buffer = torch.empty(size, dtype=torch.uint8).share_memory_()
    with torch.no_grad():
        for name, t in tensors.items():
            _view(buffer, *layout[name]).copy_(t)
    return buffer, layout


def _view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    return buffer[offset : offset + shape.numel() * dtype.itemsize].view(dtype).view(shape)


def _wait(connection: Connection, timeout: float | None, what: str) -> bytes:
    if timeout is not None and not connection.poll(timeout):
        raise TimeoutError(f"waited {timeout:g} s for {what} from the other process: none came")
    try:
        return connection.recv_bytes()
    except EOFError:
        raise ConnectionError(f"the other process closed the connection before sending {what}") from None
