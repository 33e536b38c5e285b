"""Which implementation an op runs: its Triton kernel or its PyTorch reference.

`MOEMESH_KERNELS` chooses, read at every call (so tests can switch it):
  auto (default)  Triton on CUDA tensors, the reference anywhere else;
  triton          always Triton; CPU tensors need `TRITON_INTERPRET=1` (Triton's interpreter);
  torch           always the reference.

Triton is optional: without it `import moemesh.ops` still works and the references run. The kernel
files decorate their kernels with `triton.jit` at import time, so where Triton is missing a
stand-in `triton`/`tl` (the same trick torch._inductor uses) lets those definitions load unused.
It takes what the real decorators take (`triton.jit(do_not_specialize=...)`, `triton.Config(...,
num_warps=...)`), and `tests/test_ops_backend.py` imports every module of moemesh with Triton
hidden, so a kernel file that needs more of Triton at import fails a test, not a user's first run.
"""

import contextlib
import functools
import os

import torch
import torch.distributed as dist

from moemesh.errors import ConfigError

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class triton:  # noqa: N801 - stand-in for the module
        @staticmethod
        def jit(fn=None, **options):
            """As `triton.jit`: `@triton.jit` and `@triton.jit(do_not_specialize=...)` alike."""
            return fn if fn is not None else (lambda kernel: kernel)

        class Config:
            def __init__(self, kwargs, **options):
                self.kwargs = kwargs

    class tl:  # noqa: N801 - stand-in for the module
        constexpr = None


# `triton.jit` picks the interpreter when a kernel is *defined*, i.e. when moemesh.ops is imported,
# which happens right after this module is imported; setting the variable later has no effect.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

_MODES = ("auto", "triton", "torch")


def kernel_mode() -> str:
    mode = os.environ.get("MOEMESH_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ConfigError(f"MOEMESH_KERNELS={mode!r}: expected one of {', '.join(_MODES)}")
    return mode


def use_triton(tensor: torch.Tensor) -> bool:
    """True when the op on `tensor` should run its Triton kernel, False for the reference."""
    mode = kernel_mode()
    if mode == "torch":
        return False
    if mode == "auto":
        return HAVE_TRITON and tensor.is_cuda
    if not HAVE_TRITON:
        raise ConfigError("MOEMESH_KERNELS=triton, but the triton package is not installed")
    if not tensor.is_cuda and not INTERPRETED:
        raise ConfigError(
            "MOEMESH_KERNELS=triton on a CPU tensor needs TRITON_INTERPRET=1 in the environment "
            "before moemesh.ops is imported"
        )
    return True


def tuned(configs: list, key: list[str], prune=None):
    """`triton.autotune` over `configs` (the fastest per value of the `key` arguments, timed at the
    first launch of each): for the decoding kernels, whose best tile depends on the GPU and shape.
    Their keys hold the number of rows as a size class (the next power of two), so that a prompt
    of any length meets tiles tuned for the engine's batch sizes (`DecodeEngine.warm_up`).
    The first launch of a shape must not be inside a CUDA graph capture (the engine's eager
    warm-up step comes first). `prune(configs, named_args, **kwargs)` drops the configs a launch
    cannot take. Triton's CPU interpreter cannot time kernels: there the first config runs. Inside
    `agreed_tiles(group)` the ranks of the group pick the same config."""

    def wrap(kernel):
        if INTERPRETED or not HAVE_TRITON:
            return _FirstConfig(kernel, configs[0])
        pruning = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}
        return triton.autotune(configs=configs, key=key, do_bench=agreed_timing, **pruning)(kernel)

    return wrap


# The process group whose ranks pick the same tiles (`agreed_tiles`), or None.
_tiles_group = None


@contextlib.contextmanager
def agreed_tiles(group):
    """Inside, a tuned kernel's first launch of a shape times each config on every rank of `group`
    (None: this rank alone) and takes the sum of their times, so that every rank picks the same
    config. Why: a config sums a row's products in an order of its own, and tensor parallelism
    computes some tensors on every rank alike — the router's logits from the same tokens (and
    under expert parallelism for decoding, the whole attention): ranks that picked different
    tiles could give a token different logits in the last bit, and route it differently on a
    near-tie. Every rank of the group must launch the same kernels with the same shapes inside
    (the engine's steps do: the leader announces each)."""
    global _tiles_group
    before, _tiles_group = _tiles_group, group
    try:
        yield
    finally:
        _tiles_group = before


def _timed(kernel_call, quantiles) -> list[float]:
    """The autotuner's own benchmark of `kernel_call` on this rank (ms at `quantiles`)."""
    from triton.runtime.driver import driver

    return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)


def agreed_timing(kernel_call, quantiles) -> list[float]:
    """Triton's autotuner's benchmark (`do_bench`): `kernel_call` timed on this rank, then, inside
    `agreed_tiles`, summed over its group's ranks. A config that fails on any rank (past the
    GPU's resources) is infinitely slow on every one; the failing rank raises its error."""
    failure = None
    try:
        times = list(_timed(kernel_call, quantiles))
    except Exception as error:  # the autotuner catches what it knows (OutOfResources, ...)
        failure, times = error, [0.0] * len(quantiles)
    group = _tiles_group
    if group is not None:
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) else "cpu"
        summed = torch.tensor([*times, failure is not None], dtype=torch.float64, device=device)
        dist.all_reduce(summed, group=group)
        *times, failed = summed.tolist()
        if failed and failure is None:
            return [float("inf")] * len(quantiles)
    if failure is not None:
        raise failure
    return times


class _FirstConfig:
    """`kernel[grid](...)` with the meta-parameters of one config (see `tuned`)."""

    def __init__(self, kernel, config):
        self.kernel, self.config = kernel, config

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            meta = {**kwargs, **self.config.kwargs}
            return self.kernel[grid(meta) if callable(grid) else grid](*args, **meta)

        return launch


# Programmatic dependent launch (compute capability 9.0 and newer): a kernel launched with it may
# start while the kernel before it in the stream is still running, and must wait (`wait_for_inputs`)
# before it reads or writes what that kernel touches. A decode step is some 700 kernels of a few
# microseconds each, run back to back from a CUDA graph; this lets each one's launch overlap the
# tail of the one before. With the residual adds fused into the norms (a torch kernel between two
# Triton ones ends the chain), a decode step of the 48-layer shape ran 1.06-1.07x faster on
# one H200 and 1.07-1.18x at TP=2 (docs/benchmarks.md, 2026-11-28). False: every kernel launched
# plainly (for measuring the difference).
DEPENDENT_LAUNCH = True


def dependent_launch(tensor: torch.Tensor) -> dict:
    """Launch arguments for a kernel whose first statement is `wait_for_inputs(GDC)`: where the
    GPU and Triton support it, launched as a programmatic dependent launch; elsewhere (the CPU's
    interpreter, older GPUs) plainly, the wait compiled out."""
    if DEPENDENT_LAUNCH and tensor.is_cuda and not INTERPRETED and _dependent_launch_supported(tensor.device.index):
        return {"GDC": True, "launch_pdl": True}
    return {"GDC": False}


@functools.cache
def _dependent_launch_supported(device_index: int | None) -> bool:
    if torch.version.hip is not None:  # ROCm reports its own capabilities: no such launch there
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # not NVIDIA's backend
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device_index)[0] >= 9


@triton.jit
def wait_for_inputs(GDC: tl.constexpr):
    """A kernel's first statement (see `dependent_launch`): under a dependent launch, wait until
    the kernel before it has finished and its writes are visible, then let the next one launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def block_size(n: int, smallest: int = 16, largest: int = 1024) -> int:
    """Power-of-two tile width covering `n` columns, clamped to [smallest, largest]; the kernels
    mask the tail, so any `n` works."""
    return max(smallest, min(largest, 1 << max(n - 1, 0).bit_length()))


def autocast_inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Autocast does not reach custom ops: cast their matmul inputs to its dtype ourselves, as it
    would for a linear layer."""
    device_type = tensors[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) for t in tensors)
