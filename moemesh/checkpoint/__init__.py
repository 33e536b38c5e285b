"""Checkpoints: DCP save/load/verify, Hugging Face read/write by slices, run-directory lookup."""
