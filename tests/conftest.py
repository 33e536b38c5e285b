import os
import zlib

import pytest
import torch

from triton_interpreter import patch_lang_once_per_launch

# Triton's interpreter runs the kernels on CPU tensors. triton.jit reads this variable when a kernel
# is defined (at `import moemesh.ops`), so it is set here, before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _dot_by_rows() -> None:
    """The interpreter's fp32 tl.dot as a GPU's: each output element the same sum over K wherever its
    row sits in the tile. The interpreter's is numpy's matmul, whose BLAS (OpenBLAS 0.3.31, numpy
    2.4) sums a tile's last rows by another kernel than its first: a row's last bit then depended on
    its place, and the batch-invariant kernels' tests saw the BLAS, not the kernel. einsum without
    BLAS (optimize=False) sums each element alone."""
    try:
        import numpy as np
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        return
    numpy_dot = builder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return numpy_dot(self, a, b, d, *args, **kwargs)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, optimize=False)
        return interpreter.TensorHandle((product + d.data).astype(d.data.dtype), d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _dot_by_rows()
    patch_lang_once_per_launch()


@pytest.fixture(autouse=True)
def seed(request):
    """Fresh random inputs for every test, reproducible from its name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture
def triton_kernels(monkeypatch):
    """Force the Triton kernels: compiled on a GPU, interpreted on CPU."""
    from moemesh.ops.backend import HAVE_TRITON

    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("MOEMESH_KERNELS", "triton")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):  # where tensors are made
        yield


@pytest.fixture(scope="module")
def pool(request):
    """A gloo process group of the test module's WORLD ranks, started once for the whole module."""
    from multiprocess import WorkerPool

    workers = WorkerPool(request.module.WORLD)
    yield workers
    workers.close()
