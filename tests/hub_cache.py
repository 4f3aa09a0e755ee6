"""A Hugging Face hub cache laid out as huggingface_hub lays it out, written without the network.

    models--org--name/blobs/<sha256>            file contents
    models--org--name/snapshots/<commit>/<file> -> ../../blobs/<sha256> (relative symlinks)
    models--org--name/refs/main                 <commit>

`huggingface_hub.scan_cache_dir` reads it back, so a test can check the layout is the library's.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def populate(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT) -> Path:
    """Write `files` as revision `commit` (= main) of model repo `repo_id`; -> the snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def populate_from_dir(cache: Path, repo_id: str, directory: Path) -> Path:
    return populate(cache, repo_id, {p.name: p.read_bytes() for p in Path(directory).iterdir() if p.is_file()})
