"""Where the compiled extension lives, and loading it without a compiler at run time.

`python -m kvstate.kernels.build` compiles `csrc/` into `_build/` (gitignored) and records a hash
of the sources next to the library; `load()` imports that library only if the hash still matches,
so an edited kernel is never silently run from a stale build (the torch path runs instead, and
`info()` says why).
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

NAME = "kvstate_gemv"
HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
BUILD_DIR = HERE / "_build"
LIBRARY = BUILD_DIR / f"{NAME}.so"
STAMP = BUILD_DIR / "sources.sha256"

_loaded: dict[str, object] = {}  # "module" -> the extension, "reason" -> why it is not there


def sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def sources_hash() -> str:
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def load():
    """The extension module, or None (see `unavailable_reason()`). Cached after the first call."""
    if "module" not in _loaded:
        _loaded["module"], _loaded["reason"] = _try_load()
    return _loaded["module"]


def unavailable_reason() -> str | None:
    load()
    return _loaded["reason"]


def forget() -> None:
    """Drop the cached answer (after a build in the same process)."""
    _loaded.clear()


def _try_load():
    if not LIBRARY.exists():
        return None, "not built (run `python -m kvstate.kernels.build`)"
    if not STAMP.exists() or STAMP.read_text().strip() != sources_hash():
        return None, "stale build: csrc/ changed since it was built (rerun `python -m kvstate.kernels.build`)"
    import torch  # noqa: F401  (the library links against libtorch, which must be loaded first)

    try:
        spec = importlib.util.spec_from_file_location(NAME, LIBRARY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:  # e.g. built against another torch
        return None, f"cannot load {LIBRARY.name}: {e}"
    if not module.isas():
        return None, "this CPU has neither AVX-512 nor AVX2+FMA"
    return module, None
