"""Compile the CPU kernels at install: `python -m kvstate.kernels.build` (the Makefile's install step).

Uses torch's own extension builder with the machine's compiler. It never fails the install: it
prints one line saying whether the kernels built (and where the full log is when they did not),
and without them `kvstate.kernels.linear` runs the pure-torch path.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import time

from kvstate.kernels import _ext


def build(verbose: bool = False) -> tuple[bool, str]:
    """Build into kvstate/kernels/_build; returns (built, one-line message)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return False, "no C++ compiler found"
    try:
        from torch.utils import cpp_extension

        cpp_extension.verify_ninja_availability()
    except (ImportError, RuntimeError) as e:
        return False, f"cannot build: {e}"
    _ext.BUILD_DIR.mkdir(exist_ok=True)
    log = _ext.BUILD_DIR / "build.log"
    digest = _ext.sources_hash()
    _ext.STAMP.unlink(missing_ok=True)
    t0 = time.perf_counter()
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cpp_extension.load(
                name=_ext.NAME,
                sources=[str(p) for p in _ext.sources() if p.suffix == ".cpp"],
                # OpenMP: at::parallel_for is inlined into the extension; torch's libgomp serves it.
                extra_cflags=["-O3", "-fopenmp", "-DNDEBUG"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_ext.BUILD_DIR),
                verbose=verbose,
            )
    except Exception as e:  # a compiler error must not fail the install
        log.write_text(out.getvalue() + f"\n{e}\n")
        first = next((ln for ln in str(e).splitlines() if "error" in ln.lower()), str(e).splitlines()[0])
        return False, f"build failed ({first.strip()[:160]}); log: {log}"
    log.write_text(out.getvalue())
    _ext.STAMP.write_text(digest + "\n")
    _ext.forget()
    module = _ext.load()
    if module is None:
        return False, f"built but unusable: {_ext.unavailable_reason()}"
    secs = time.perf_counter() - t0
    return True, f"built in {secs:.0f} s ({', '.join(module.isas())}) -> {_ext.LIBRARY}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.kernels.build", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    ok, message = build(verbose=args.verbose)
    fallback = "" if ok else "; the torch fallback will be used"
    print(f"kvstate kernels: {message}{fallback}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
