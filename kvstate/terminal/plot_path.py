"""Where a `--plot FILE` goes: checked before any work starts, so a long run does not end in a
traceback at the last step (`kvstate memory`, `kvstate recall phonebook`, `kvstate recall capacity`)."""

from __future__ import annotations

import os
from pathlib import Path

from kvstate.errors import KvstateError

FORMATS = {".png": "png", ".svg": "svg"}  # suffix -> matplotlib's format


def check_plot_path(path: str | Path, flag: str = "--plot") -> Path:
    """`path` as a Path when matplotlib can write a chart there; a one-line KvstateError otherwise."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise KvstateError(f"{flag}: {path}: the file name must end in .png or .svg")
    if not path.parent.is_dir():
        raise KvstateError(f"{flag}: {path}: no such directory {path.parent}")
    if path.is_dir():
        raise KvstateError(f"{flag}: {path} is a directory")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise KvstateError(f"{flag}: {path}: not writable")
    return path
