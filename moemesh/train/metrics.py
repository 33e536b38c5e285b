"""metrics.jsonl: one JSON object per optimizer step (and one for the evaluation before step 1)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsLog:
    """Appends records to metrics.jsonl, flushed after each so a crash loses nothing. A resumed
    run first drops the records past its checkpoint: those steps are about to run again."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step] if resume_step is not None else []
        self._file = self.path.open("w")
        for record in kept:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
