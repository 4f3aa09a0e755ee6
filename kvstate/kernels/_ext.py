"""Where the compiled extension lives, building it once on first use, and loading it.

The C++ sources (`csrc/`) ship inside the package, so every install (editable, wheel, sdist) can
build them for the machine it runs on. The library goes to a per-user cache,
`$KVSTATE_KERNELS_CACHE` or `~/.cache/kvstate/kernels` (`$XDG_CACHE_HOME` respected), in a folder
named by a hash of the sources, torch's version, the Python ABI and the flags: an edited kernel or
another torch gets its own build, never a stale one, and installs that match share one. The first
`load()` that finds no build compiles it (one progress line on stderr; `make install` and
`python -m kvstate.kernels.build` do it up front); a build that cannot run leaves one line on
stderr, and `info()` says why the torch fallback runs. `KVSTATE_KERNELS_BUILD=0` turns the build
on first use off.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import sys
from pathlib import Path

NAME = "kvstate_gemv"
HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
# OpenMP: at::parallel_for is inlined into the extension; torch's libgomp serves it.
CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)
CACHE_ENV = "KVSTATE_KERNELS_CACHE"
BUILD_ENV = "KVSTATE_KERNELS_BUILD"
REBUILD_HINT = "run `python -m kvstate.kernels.build`"

_loaded: dict[str, object] = {}  # "module" -> the extension, "reason" -> why it is not there


def sources() -> list[Path]:
    if not CSRC.is_dir():
        return []
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))


def toolchain() -> str:
    """What a build depends on besides the sources: torch's version, the Python ABI, machine, flags."""
    import torch

    return " ".join((torch.__version__, sys.implementation.cache_tag, platform.machine(), *CFLAGS, *LDFLAGS))


def build_key() -> str:
    """16 hex digits naming the build: the sources and the toolchain."""
    h = hashlib.sha256()
    for p in sources():
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    for part in toolchain().split(" "):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstate" / "kernels"


def build_dir() -> Path:
    return cache_root() / build_key()


def library() -> Path:
    return build_dir() / f"{NAME}.so"


def stamp() -> Path:
    """Written (with the key) once a build in build_dir() succeeded: the library there is whole."""
    return build_dir() / "built"


def failed_marker() -> Path:
    """Written when a compile failed, with its one-line message: later processes do not retry it."""
    return build_dir() / "failed"


def auto_build() -> bool:
    return os.environ.get(BUILD_ENV, "1").strip().lower() not in ("0", "no", "off", "false")


def load():
    """The extension module, or None (see `unavailable_reason()`). Cached after the first call."""
    if "module" not in _loaded:
        _loaded["module"], _loaded["reason"] = _try_load()
    return _loaded["module"]


def unavailable_reason() -> str | None:
    load()
    return _loaded["reason"]


def peek():
    """(module, reason) if this process has asked for the extension, else None; never builds."""
    return (_loaded["module"], _loaded["reason"]) if "module" in _loaded else None


def forget() -> None:
    """Drop the cached answer (after a build in the same process)."""
    _loaded.clear()


def adopt(module) -> None:
    """Use this freshly compiled module (a build in this process imported it already)."""
    _loaded["module"], _loaded["reason"] = _ready(module)


def _try_load():
    if not sources():
        return None, f"the kernel sources are missing from this install ({CSRC})"
    if not stamp().exists():
        if failed_marker().exists():
            return None, f"{failed_marker().read_text().strip()} ({REBUILD_HINT} to retry)"
        if not auto_build():
            return None, f"not built ({BUILD_ENV}=0; {REBUILD_HINT})"
        from kvstate.kernels import _compile

        built, message, module = _compile.build(progress=True)
        if not built:  # (the build said so on stderr, in one line)
            return None, message
        if module is not None:
            return _ready(module)
    import torch  # noqa: F401  (the library links against libtorch, which must be loaded first)

    path = library()
    try:
        spec = importlib.util.spec_from_file_location(NAME, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        return None, f"cannot load {path}: {e}"
    return _ready(module)


def _ready(module):
    """The module with the ISA cap of KVSTATE_KERNELS applied, or why it cannot serve this CPU."""
    if not module.isas():
        return None, "this CPU has neither AVX-512 nor AVX2+FMA"
    from kvstate.kernels.dispatch import backend_from_env

    cap = backend_from_env()
    module.set_isa_cap(cap if cap in ("avx512", "avx2") else "auto")
    return module, None
