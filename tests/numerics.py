"""The error measure every numerical test states its tolerance in."""

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ (Frobenius), computed in float64."""
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()
