"""Compile the CPU kernels now: `python -m kvstate.kernels.build` (the Makefile's install step).

Every install ships the sources and builds them on first use anyway (`kvstate.kernels._ext`); this
command does it up front, into the same per-user cache. It prints one line: where the kernels are
and which ISAs they serve, or why they did not build (the torch fallback then runs). It exits 0
either way, unless the kernels are required (`KVSTATE_REQUIRE_KERNELS=1`, or `CI` set): then a
missing extension exits 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvstate.kernels import _compile, _ext

REQUIRE_ENV = "KVSTATE_REQUIRE_KERNELS"


def required() -> bool:
    """Must the extension load here? KVSTATE_REQUIRE_KERNELS=1, or a CI run (CI set, not false/0)."""
    flag = os.environ.get(REQUIRE_ENV)
    if flag is not None and flag.strip():
        return flag.strip().lower() not in ("0", "no", "off", "false")
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "no", "off", "false")


def build(force: bool = False, verbose: bool = False) -> tuple[bool, str]:
    """(loaded, one-line message) after building unless up to date (`force`: rebuild)."""
    if not _ext.sources():
        return False, f"the kernel sources are missing from this install ({_ext.CSRC})"
    built, message, module = _compile.build(force=force, verbose=verbose)
    if not built:
        return False, message
    _ext.forget()
    if module is not None:  # compiled in this process: already imported
        _ext.adopt(module)
    module = _ext.load()
    if module is None:
        return False, f"built but unusable: {_ext.unavailable_reason()}"
    return True, f"{message} ({', '.join(module.isas())})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.kernels.build", description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if this build is in the cache")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    args = parser.parse_args(argv)
    ok, message = build(force=args.force, verbose=args.verbose)
    if ok:
        print(f"kvstate kernels: {message}")
        return 0
    if required():
        print(f"kvstate kernels: {message}; required here ({REQUIRE_ENV}=1 or CI)", file=sys.stderr)
        return 1
    print(f"kvstate kernels: {message}; the torch fallback will be used")
    return 0


if __name__ == "__main__":
    sys.exit(main())
