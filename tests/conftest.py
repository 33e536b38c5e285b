import os
import zlib

import pytest
import torch

# Triton's interpreter runs the kernels on CPU tensors. triton.jit reads this variable when a kernel
# is defined (at `import moemesh.ops`), so it is set here, before any test module imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
