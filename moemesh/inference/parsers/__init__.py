"""A model family's output formats: its tool calls and its reasoning, read from the text it
generates (registry.py chooses them; base.py is what they share)."""
