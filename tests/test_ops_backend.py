"""Kernel dispatch: MOEMESH_KERNELS, clear errors, and moemesh.ops without triton installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moemesh.errors import ConfigError
from moemesh.ops import backend, combine


def test_modes(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("MOEMESH_KERNELS", "torch")
    assert not backend.use_triton(cpu)
    monkeypatch.setenv("MOEMESH_KERNELS", "auto")
    assert not backend.use_triton(cpu)  # auto runs Triton on CUDA tensors only
    monkeypatch.delenv("MOEMESH_KERNELS")
    assert not backend.use_triton(cpu)
    monkeypatch.setenv("MOEMESH_KERNELS", "cuda")
    with pytest.raises(ConfigError, match="MOEMESH_KERNELS='cuda'"):
        backend.use_triton(cpu)


def test_forced_triton_errors_are_clear(monkeypatch):
    monkeypatch.setenv("MOEMESH_KERNELS", "triton")
    monkeypatch.setattr(backend, "INTERPRETED", False)
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        combine(torch.zeros(2, 3), torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1))
    monkeypatch.setattr(backend, "HAVE_TRITON", False)
    with pytest.raises(ConfigError, match="not installed"):
        backend.use_triton(torch.zeros(1))


def test_block_size():
    assert [backend.block_size(n) for n in (0, 1, 16, 17, 130, 1000, 5000)] == [16, 16, 16, 32, 256, 1024, 1024]


def test_dependent_launch_only_where_a_gpu_compiles(monkeypatch):
    """CPU tensors (Triton's interpreter, or the references) launch plainly: GDC=False compiles the
    kernels' wait out, and `launch_pdl` is not passed to a launcher that has none. Turned off, a
    GPU's launches are plain too."""
    assert backend.dependent_launch(torch.zeros(1)) == {"GDC": False}
    monkeypatch.setattr(backend, "DEPENDENT_LAUNCH", False)
    if torch.cuda.is_available():
        assert backend.dependent_launch(torch.zeros(1, device="cuda")) == {"GDC": False}


def test_ops_work_without_triton():
    """With `import triton` failing, every module of moemesh imports (the stand-in takes what
    `triton.jit` takes), the references run, and forcing Triton names the problem."""
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import importlib, os, pkgutil, torch
import moemesh
for module in pkgutil.walk_packages(moemesh.__path__, "moemesh."):  # every kernel file defines its kernels
    if module.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(module.name)
    except ModuleNotFoundError as error:  # an optional extra (fastapi, ...) that is not installed
        assert error.name != "triton" and not error.name.startswith("triton."), (module.name, error)
from moemesh.ops import permute, combine, swiglu, linear_cross_entropy
x = torch.randn(5, 4)
p = permute(x, torch.tensor([[0, 1]] * 5), 3, align=4)
assert torch.allclose(combine(p.grouped, p.position, torch.full((5, 2), 0.5)), x)
assert swiglu(torch.randn(5, 8)).shape == (5, 4)
linear_cross_entropy(x, torch.randn(7, 4), torch.arange(5))
os.environ["MOEMESH_KERNELS"] = "triton"
try:
    swiglu(torch.randn(5, 8))
except Exception as e:
    print(type(e).__name__, e)
"""
    root = Path(__file__).resolve().parents[1]
    env = {key: value for key, value in os.environ.items() if key != "MOEMESH_KERNELS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "ConfigError" in result.stdout and "triton package is not installed" in result.stdout
