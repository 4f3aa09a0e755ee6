"""A GGUF file as a checkpoint folder: config.json, tokenizer files, a link to the file and its tensor table.

Everything that opens a checkpoint directory (the loader, the tokenizer, the engine, the CLI)
then opens a GGUF file unchanged. The folder lives in the kvstate cache
(`$KVSTATE_GGUF_CACHE` or `~/.cache/kvstate/gguf`, `$XDG_CACHE_HOME` respected), keyed by the
file's absolute path, size and modification time, and is written once. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from kvstate.errors import KvstateError
from kvstate.gguf import GGUF_LINK
from kvstate.gguf.metadata import config_of, open_reader
from kvstate.gguf.tensors import write_table
from kvstate.gguf.tokenizer import write_tokenizer

CACHE_ENV = "KVSTATE_GGUF_CACHE"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvstate" / "gguf"


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint folder standing for the GGUF file at `path` (written on first use)."""
    path = Path(path).absolute()  # its own name (a hub snapshot's file is a link to a blob named by hash)
    if not path.is_file():
        raise KvstateError(f"{path}: no such file")
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = cache_root() / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    reader = open_reader(path)
    config = config_of(reader)
    try:
        cache_root().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-"))
    except OSError as exc:
        raise KvstateError(f"{cache_root()}: cannot write the GGUF cache ({exc.strerror or exc})") from None
    try:
        if reader.fields.get("tokenizer.ggml.tokens") is not None:
            write_tokenizer(reader, tmp)
        (tmp / GGUF_LINK).symlink_to(path.resolve())
        write_table(reader, tmp)  # where the tensors lie: a load then skips parsing the metadata again
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tmp.replace(folder) if not folder.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def gguf_file(folder: Path) -> Path | None:
    """The GGUF file a checkpoint folder stands for (its link, named *.gguf), or None for an ordinary checkpoint."""
    link = folder / GGUF_LINK
    return link if link.is_file() else None
