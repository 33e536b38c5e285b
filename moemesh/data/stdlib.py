"""The embedded default corpus: the Python standard library's own source files, present wherever
Python is, so the default run needs no download."""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path

# Third-party packages live below the stdlib directory but are not part of it.
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """Every `.py` file of the standard library, in a fixed order that depends only on the file
    names: sorted by a hash of the relative path, so that the validation tail of the stream is a
    sample of all modules rather than the alphabetically last ones."""
    root = Path(sysconfig.get_paths()["stdlib"])
    relative = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in _NOT_STDLIB]
        base = Path(directory).relative_to(root)
        relative += [(base / name).as_posix() for name in files if name.endswith(".py")]
    relative.sort(key=lambda name: (zlib.crc32(name.encode()), name))
    return [root / name for name in relative]
