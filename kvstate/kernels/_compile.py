"""Compile csrc/ into the cache folder `_ext.build_dir()` with torch's extension builder.

Used on first use (`_ext.load`) and by `python -m kvstate.kernels.build`. Processes that start at
once (pytest workers, two servers) take a file lock: one compiles, the others wait and load it.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import shutil
import sys
import time

from kvstate.kernels import _ext


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
    where = _ext.build_dir()
    try:
        where.mkdir(parents=True, exist_ok=True)
        lock = open(where.parent / f"{where.name}.lock", "w")  # noqa: SIM115 (held until the build ends)
    except OSError as e:
        return False, f"cannot write the kernel cache {where.parent}: {e.strerror} (set {_ext.CACHE_ENV})", None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _ext.stamp().exists() and not force:
            return True, f"up to date: {_ext.library()}", None
        return _compile(cpp_extension, progress, verbose, started)


def _compile(cpp_extension, progress: bool, verbose: bool, started: list) -> tuple[bool, str, object]:
    where, log = _ext.build_dir(), _ext.build_dir() / "build.log"
    _ext.stamp().unlink(missing_ok=True)
    _ext.failed_marker().unlink(missing_ok=True)
    if progress:
        print(f"kvstate kernels: compiling for this CPU, once (about a minute) into {where} ...",
              end="", file=sys.stderr, flush=True)
        started.append(True)
    t0 = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            # it imports the module too: a second import of the library would register its types twice
            module = cpp_extension.load(name=_ext.NAME, sources=[str(p) for p in _ext.sources() if p.suffix == ".cpp"],
                               extra_cflags=list(_ext.CFLAGS), extra_ldflags=list(_ext.LDFLAGS),
                               build_directory=str(where), verbose=verbose)
    except Exception as e:  # a compiler error must not fail the caller
        log.write_text(out.getvalue() + f"\n{e}\n")
        lines = str(e).splitlines() or [type(e).__name__]
        first = next((ln for ln in lines if "error" in ln.lower()), lines[0])
        message = f"build failed ({first.strip()[:160]}); log: {log}"
        _ext.failed_marker().write_text(message + "\n")
        return False, message, None
    log.write_text(out.getvalue())
    _ext.stamp().write_text(f"{where.name}\n{_ext.toolchain()}\n")
    secs = time.perf_counter() - t0
    if progress:
        print(f" done in {secs:.0f} s", file=sys.stderr, flush=True)
    return True, f"built in {secs:.0f} s: {_ext.library()}", module

