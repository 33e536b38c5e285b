"""metrics.jsonl: one JSON object per optimizer step (and one for the evaluation before step 1)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:  # the half-written line of a run that died while writing it
        pass
    return records


class MetricsLog:
    """Appends records to metrics.jsonl, flushed after each so a crash loses nothing. A resumed
    run first drops the records past its checkpoint (those steps are about to run again): it
    rewrites the file under another name and renames it, so a crash in between loses nothing either."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        if resume_step is not None:
            kept = [r for r in read_metrics(self.path) if r["step"] <= resume_step]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(_line(record) for record in kept))
            os.replace(tmp, self.path)
        self._file = self.path.open("a" if resume_step is not None else "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _line(record: dict[str, Any]) -> str:
    # Strict JSON, which has no NaN or Infinity: a skipped step's non-finite loss is written as null.
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False) + "\n"
