"""The explorer's own worker: its model forwards never take a thread that /v1 needs.

    result = await explorer_pool.run(request.app, fn)     # fn() on the explorer's one thread

Every explorer forward beside the engine thread (recall, gates, compare, cache timing) runs on one
thread of its own, one at a time (as the old shared lock made them): FastAPI's thread pool, which
/v1 tokenizes and renders chat templates on, is never held by an explorer call waiting for the
model. At most MAX_WAITING calls queue for it; more is a 429, so a burst of explorer calls costs
memory and time only for the explorer.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvstate.errors import KvstateError
from kvstate.server.protocol import ApiError

MAX_WAITING = 8


class ExplorerPool:
    def __init__(self, max_waiting: int = MAX_WAITING):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstate-explorer")
        self.max_waiting, self.waiting = max_waiting, 0  # touched on the event loop only

    async def run(self, fn):
        if self.waiting >= self.max_waiting:
            raise ApiError(f"the explorer is busy ({self.waiting} calls queued): try again in a moment",
                           status=429, type="rate_limit_error")
        self.waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn)
        except KvstateError as exc:
            raise ApiError(str(exc).splitlines()[0]) from None
        finally:
            self.waiting -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def pool(app) -> ExplorerPool:
    """The app's explorer pool, made on first use (on the event loop: no race)."""
    found = getattr(app.state, "explorer_pool", None)
    if found is None:
        found = app.state.explorer_pool = ExplorerPool()
    return found


async def run(app, fn):
    """fn() on the explorer's thread; a KvstateError it raises is a 400 (its first line)."""
    return await pool(app).run(fn)
