"""A micro-batch's forward and backward as one CUDA graph (`train.cuda_graphs`).

Why: a LoRA step of the 48-layer Qwen3-30B-A3B shape launches ~150 kernels a layer (forward,
recomputed forward, backward), most of them small, each costing the host tens of microseconds of
Python and autograd; on one H200 the host took about twice the GPU's time (docs/benchmarks.md).
Captured once, a step's forward and backward are one graph launch: the host's share goes, and the
GPU runs the kernels back to back.

How: `fn(*inputs)` runs the forward and calls backward itself, reading its data from fixed
input buffers (each call copies the micro-batch into them). It runs eagerly first, on a side
stream (Triton's autotuning, lazy initialisation and cuBLAS workspaces happen outside the graph),
then is captured. Gradients: the trained parameters' `.grad` exist (zeros) before the warm-up, and
backward adds into them in place, so a replay accumulates the micro-batch's gradient just as an
eager backward does; the trainer zeroes them between steps (`zero_grad(set_to_none=False)`), and
clipping and the optimizer read them eagerly after the replays. What `fn` returns (the loss) is
overwritten by the next replay: read it before.

State the forward changes must change in place: a tensor the graph reads and the forward then
replaces would be read at its capture-time address ever after (the routers' expert counts are
added in place for this, `models.moe.count_load`, and the trainer zeroes them in place).

Limits (the trainer's config checks say so): one process, a GPU and bf16 (the experts' grouped
GEMMs wait for the host in fp32 and on the CPU), no LoRA dropout (each replay would draw the
capture's random numbers). The shapes are the capture's: train.micro_batch × train.seq_len.
Nothing in `fn` may wait for the host; a path that does fails the capture (a ConfigError that
says so, with CUDA's error).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from moemesh.errors import ConfigError


class CapturedStep:
    def __init__(
        self,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        example_inputs: Sequence[torch.Tensor],
        params: Sequence[torch.nn.Parameter],
        warmup: int = 2,
    ):
        if not all(t.is_cuda for t in example_inputs):
            raise ValueError("CUDA graphs need the step's inputs on a CUDA device")
        self.inputs = [t.clone() for t in example_inputs]
        self.params = list(params)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # Threads other than this one (autograd's, an overlapped pipeline's forward thread, NCCL's
            # watchdog) may make calls that capture forbids process-wide: only this thread's are checked.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.outputs = fn(*self.inputs)
        except torch.OutOfMemoryError:
            raise  # not a path that waits for the host: the step does not fit
        except RuntimeError as error:  # CUDA's "operation not permitted when stream is capturing", ...
            raise ConfigError(
                "train.cuda_graphs: the step could not be captured as a CUDA graph, as something in it "
                "waits for the host (adapters read from lora.init_from of a rank that is not a multiple "
                f"of 8 on the experts, for one); set train.cuda_graphs = false. CUDA said: {error}"
            ) from error
        self.zero_grad()  # the warm-up's gradients
        torch.cuda.empty_cache()  # the warm-up's cached blocks: the graph's own pool holds what it needs

    def close(self) -> None:
        """Free the graph now. Before the process group is destroyed: NCCL's teardown waits forever
        while a graph that captured its collectives exists (pytorch/pytorch#115388)."""
        self.graph.reset()
        self.outputs = ()

    def zero_grad(self) -> None:
        torch._foreach_zero_([p.grad for p in self.params])

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copy `inputs` into the buffers and replay: the gradients are added to `.grad`."""
        for buffer, value in zip(self.inputs, inputs, strict=True):
            buffer.copy_(value, non_blocking=True)
        self.graph.replay()
        return self.outputs
