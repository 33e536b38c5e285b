"""Leaf ops, each a PyTorch reference + a Triton kernel + an autograd Function (see backend.py)."""

from moemesh.ops.combine import combine
from moemesh.ops.linear_cross_entropy import linear_cross_entropy
from moemesh.ops.permute import Permuted, permute
from moemesh.ops.rms_norm import rms_norm
from moemesh.ops.swiglu import swiglu

__all__ = ["combine", "linear_cross_entropy", "Permuted", "permute", "rms_norm", "swiglu"]
