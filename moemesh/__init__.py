"""moemesh: Mixture-of-Experts transformers across many GPUs, proven correct on CPUs."""

__version__ = "0.1.0"
