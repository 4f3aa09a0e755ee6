"""Loading the compiled extension, building it (`_compile`) once on first use.

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

import importlib.util
import os

from kvstate.kernels._compile import (  # noqa: F401 (where the build lives, as the callers of _ext know it)
    CACHE_ENV, CFLAGS, CSRC, LDFLAGS, NAME, build, build_dir, build_key, cache_root, failed_marker, library, sources,
    stamp, toolchain)

BUILD_ENV = "KVSTATE_KERNELS_BUILD"
REBUILD_HINT = "run `python -m kvstate.kernels.build`"
BACKEND_ENV = "KVSTATE_KERNELS"  # the backend to use or the ISA cap (kvstate.kernels.dispatch)

_loaded: dict[str, object] = {}  # "module" -> the extension, "reason" -> why it is not there


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


def backend_from_env() -> str:
    """The backend KVSTATE_KERNELS asks for ("auto" when unset), not yet checked."""
    return os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"


def _try_load():
    if not sources():
        return None, f"the kernel sources are missing from this install ({CSRC})"
    if not stamp().exists():
        if failed_marker().exists():
            return None, f"{failed_marker().read_text().strip()} ({REBUILD_HINT} to retry)"
        if not auto_build():
            return None, f"not built ({BUILD_ENV}=0; {REBUILD_HINT})"
        built, message, module = build(progress=True)
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
    cap = backend_from_env()
    module.set_isa_cap(cap if cap in ("avx512", "avx2") else "auto")
    return module, None
