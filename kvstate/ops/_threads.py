"""Run independent pieces of an op on a few Python threads, each doing single-threaded torch ops.

Why: the chunk and decode forms of the delta family are sequential loops of small ops (one
chunk's matmuls, one state block's update). Intra-op threads split each small op and mostly wait
on each other (barely faster on 2 cores, far slower on a loaded machine: docs/benchmarks.md).
The pieces, though, are independent (key-head groups, state blocks), and torch releases the GIL
inside its ops, so W Python threads with one torch thread each keep W cores busy. Workers write
into disjoint views of shared, preallocated outputs.

Inside `scope`, the workers and the calling thread run torch single-threaded (OpenMP's and MKL's
thread counts are per thread); the caller's setting is restored when the call ends. MAX_WORKERS
(default: torch's thread count) = 1 disables the workers; lowering MIN_WORK forces them on small
inputs (tests do).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import torch

from kvstate.kernels.threads import wide_threads

MAX_WORKERS: int | None = None  # None: torch.get_num_threads()
MIN_WORK = 1 << 24  # state-update multiply-adds below which a call stays on the calling thread

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()
_local = threading.local()


def workers(work: float, pieces: int) -> int:
    """How many workers to use for `work` multiply-adds split in at most `pieces` pieces."""
    if work < MIN_WORK or pieces < 2 or getattr(_local, "worker", False):  # small, or already in a worker
        return 1
    return max(1, min(wide_threads() if MAX_WORKERS is None else MAX_WORKERS, pieces))


@contextmanager
def scope(work: float, pieces: int, serial: bool = True):
    """Yields the number of workers for a call. With `serial`, the calling thread's torch ops run
    single-threaded for the duration (restored on exit): the op brings its own parallelism, and
    intra-op threads on its small ops only add wake-ups (on a loaded machine each parallel region
    can wait a whole scheduler time slice for its second thread)."""
    n = workers(work, pieces) if serial else 1
    if not serial:
        yield 1
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield n
    finally:
        torch.set_num_threads(threads)  # also undoes the workers' setting of the default for new threads


def _single_threaded(fn: Callable[[], object], inference: bool, grad: bool) -> object:
    if not getattr(_local, "worker", False):
        _local.worker = True
        torch.set_num_threads(1)
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):  # thread-local: the caller's modes
        return fn()


def run(tasks: list[Callable[[], object]]) -> list[object]:
    """Run the tasks concurrently, one per worker thread (inside `scope`), results in order."""
    global _pool, _pool_size
    if len(tasks) <= 1:
        return [t() for t in tasks]
    with _lock:
        if _pool is None or _pool_size < len(tasks):
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool, _pool_size = ThreadPoolExecutor(len(tasks), thread_name_prefix="kvstate-op"), len(tasks)
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        futures = [_pool.submit(_single_threaded, t, *modes) for t in tasks]
        return [f.result() for f in futures]


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """n items in `parts` contiguous ranges of near-equal size."""
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
