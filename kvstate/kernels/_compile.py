"""Where the compiled extension lives (`build_dir()`: a folder of the per-user cache named by a hash
of the sources and the toolchain), and compiling csrc/ into it with torch's extension builder.

Used on first use (`_ext.load`) and by `python -m kvstate.kernels.build`. Processes that start at
once (pytest workers, two servers) take a file lock: one compiles, the others wait and load it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
import platform
import shutil
import sys
import time
from pathlib import Path

NAME = "kvstate_gemv"
HERE = Path(__file__).resolve().parent
CSRC = HERE / "csrc"
# OpenMP: at::parallel_for is inlined into the extension; torch's libgomp serves it.
CFLAGS = ("-O3", "-fopenmp", "-DNDEBUG")
LDFLAGS = ("-fopenmp",)
CACHE_ENV = "KVSTATE_KERNELS_CACHE"


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



def build(progress: bool = False, force: bool = False, verbose: bool = False) -> tuple[bool, str, object]:
    """Build unless a build with this key exists (`force`: rebuild anyway): (built, one-line message,
    the module when this call compiled and imported it). `progress`: one line on stderr, which ends
    saying how it went (the torch fallback runs after a failure)."""
    started = []  # set once the compile's progress line is out: a failure then ends that line
    built, message, module = _build(progress, force, verbose, started)
    if progress and not built:
        print(f"{' ' if started else 'kvstate kernels: '}{message}; the torch fallback runs", file=sys.stderr,
              flush=True)
    return built, message, module


def _build(progress: bool, force: bool, verbose: bool, started: list) -> tuple[bool, str, object]:
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False, "no C++ compiler found (install g++ to get the compiled kernels)", None
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
    except (ImportError, RuntimeError) as e:
        return False, f"cannot build: {e}", None
    where = build_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = open(where.parent / f"{where.name}.lock", "w")  # noqa: SIM115 (held until the build ends)
    except OSError as e:
        return False, f"cannot write the kernel cache {where.parent}: {e.strerror} (set {CACHE_ENV})", None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp().exists() and not force:
            return True, f"up to date: {library()}", None
        return _compile(cpp_extension, progress, verbose, started)


def _compile(cpp_extension, progress: bool, verbose: bool, started: list) -> tuple[bool, str, object]:
    where, log = build_dir(), build_dir() / "build.log"
    stamp().unlink(missing_ok=True)
    failed_marker().unlink(missing_ok=True)
    if progress:
        print(f"kvstate kernels: compiling for this CPU, once (about a minute) into {where} ...",
              end="", file=sys.stderr, flush=True)
        started.append(True)
    t0 = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            # it imports the module too: a second import of the library would register its types twice
            module = cpp_extension.load(name=NAME, sources=[str(p) for p in sources() if p.suffix == ".cpp"],
                               extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                               build_directory=str(where), verbose=verbose)
    except Exception as e:  # a compiler error must not fail the caller
        log.write_text(out.getvalue() + f"\n{e}\n")
        lines = str(e).splitlines() or [type(e).__name__]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[0])
        message = f"build failed ({first.strip()[:160]}); log: {log}"
        failed_marker().write_text(message + "\n")
        return False, message, None
    log.write_text(out.getvalue())
    stamp().write_text(f"{where.name}\n{toolchain()}\n")
    secs = time.perf_counter() - t0
    if progress:
        print(f" done in {secs:.0f} s", file=sys.stderr, flush=True)
    return True, f"built in {secs:.0f} s: {library()}", module

