"""Reading a GGUF file's header: the reader, its metadata values and its tensor names (torch-free).

Shared by the per-architecture config readers (`metadata`, `hybrid_configs`) and the tokenizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvstate.errors import KvstateError


def open_reader(path: str | os.PathLike):
    """A gguf.GGUFReader on `path` (memory-mapped); a file it cannot parse is one KvstateError."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except FileNotFoundError:
        raise KvstateError(f"{path}: no such file") from None
    except Exception as exc:  # gguf raises ValueError/IndexError/struct errors on a bad or truncated file
        text = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise KvstateError(f"{path}: not a readable GGUF file ({text})") from None
    reader.source = Path(path)  # for messages: the reader keeps no name of its file
    return reader


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value as Python (str, int, float, bool or list), or `default` when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def arch_field(reader, arch: str, key: str, default: Any = None) -> Any:
    """The value of `<arch>.<key>`; absent and no `default` is one KvstateError."""
    value = field(reader, f"{arch}.{key}", default)
    if value is None:
        raise KvstateError(f"{reader.source}: GGUF metadata has no {arch}.{key}")
    return value


def tensor_names(reader) -> dict[str, Any]:
    """The reader's tensors by name."""
    return {t.name: t for t in reader.tensors}


def has_tensor(reader, name: str) -> bool:
    return any(t.name == name for t in reader.tensors)
