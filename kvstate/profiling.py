"""Named timing regions of a decode step, for `kvstate bench engine --profile` (`bench.step_profile`).

The code marks the functions a profile times with `@timed("linear")`, `@timed("norm")`, ...; no
profiler patches a module's internals. Outside `collect` (always, unless a profile runs) a marked
call costs one check of a module global before it calls through. Inside `collect(totals)` each
marked call adds its wall-clock seconds to `totals[part]` (a defaultdict(float)).

Regions of different parts should not nest (a marked call inside another part counts in both);
the coarse ones the profile subtracts from ("model", "runner") are the exception, by design.
This module imports nothing of kvstate, so every floor may use it.
"""

from __future__ import annotations

import contextlib
import functools
import time

_totals: dict[str, float] | None = None  # the active collector, None when no profile runs


def timed(part: str):
    """Decorator: the function's calls count as `part`'s time while a collector is active."""

    def mark(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            totals = _totals
            if totals is None:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part] += time.perf_counter() - t0

        return wrapper

    return mark


@contextlib.contextmanager
def collect(totals: dict[str, float]):
    """Inside the block, calls of marked functions add their seconds to totals[part]; one at a time."""
    global _totals
    if _totals is not None:
        raise RuntimeError("a profile is already collecting")
    _totals = totals
    try:
        yield totals
    finally:
        _totals = None
