"""The thread policy of a decode step: small ops on one thread, weight streaming on all of them.

A decode step is ~100 weight-streaming kernel calls between ~1,000 small ops (norms, gates, the
conv window, rotary, views) on vectors of a few thousand floats. Once such an op passes torch's
grain size (batch 8 does), torch splits it over its intra-op threads: a parallel region whose
wake-up and barrier cost more than the op, and on a shared machine the second thread may wait a
whole scheduler time slice (profiled on the 0.5b model under load: the conv update took 130x
longer at batch 8 than at batch 1 for 8x the work). Inside `small_ops_serial()` torch runs
single-threaded, and only the calls that stream weights (`kernels.linear`, inside `wide()`) and
the recurrent forms' workers (`kvstate.ops._threads`, sized by `wide_threads()`) use all threads.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_wide: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvstate_wide_threads", default=None)


def serial_outer_threads() -> int | None:
    """Inside `small_ops_serial`, the caller's thread count that `wide()` restores; None outside it."""
    return _wide.get()


def wide_threads() -> int:
    """The threads the heavy parts may use: the caller's torch threads outside `small_ops_serial`."""
    return _wide.get() or torch.get_num_threads()


@contextlib.contextmanager
def small_ops_serial():
    """torch single-threaded inside the block, its thread count restored after; `wide()` inside it
    gets the outer count back for one heavy call. Nested blocks are no-ops."""
    n = torch.get_num_threads()
    if n == 1 or _wide.get() is not None:
        yield
        return
    token = _wide.set(n)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _wide.reset(token)


@contextlib.contextmanager
def wide():
    """Inside `small_ops_serial`, all the outer threads for the block (~1 us to switch); else nothing."""
    n = _wide.get()
    if n is None:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(1)
