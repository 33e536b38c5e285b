"""The terminal progress display: one line redrawn in place on a terminal, plain lines every
`log_every` steps when the output goes to a file or a CI log."""

from __future__ import annotations

import sys
import time
from typing import TextIO

_BAR_WIDTH = 24


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def format_count(count: float) -> str:
    if count >= 1e6:
        return f"{count / 1e6:.2f}M"
    return f"{count / 1e3:.1f}k" if count >= 1e3 else f"{count:.0f}"


class Progress:
    def __init__(self, total_steps: int, start_step: int, log_every: int, stream: TextIO = sys.stdout):
        self.total, self.start, self.log_every, self.stream = total_steps, start_step, log_every, stream
        self.interactive = stream.isatty()
        self._t0 = time.perf_counter()
        self._line_open = False

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float, mfu: float | None = None) -> None:
        done = step - self.start
        eta = (time.perf_counter() - self._t0) / done * (self.total - step)
        fields = [f"loss {loss:.4f}", f"lr {lr:.2e}", f"{format_count(tokens_per_s)} tok/s"]
        if mfu is not None:
            fields.append(f"MFU {mfu:.1%}")
        fields.append(f"ETA {format_duration(eta)}")
        width = len(str(self.total))
        head = f"step {step:>{width}}/{self.total}"
        if self.interactive:
            filled = round(_BAR_WIDTH * step / self.total)
            bar = "[" + "#" * filled + "." * (_BAR_WIDTH - filled) + "]"
            self.stream.write(f"\r{head} {bar} " + " | ".join(fields) + "\x1b[K")
            self._line_open = True
        elif step % self.log_every == 0 or step == self.total:
            self.stream.write(f"{head} " + " | ".join(fields) + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own, above the progress line."""
        if self._line_open:
            self.stream.write("\r\x1b[K")
            self._line_open = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._line_open:
            self.stream.write("\n")
            self._line_open = False
        self.stream.flush()
