"""The one background thread that owns the engine core and steps it for every HTTP client.

    loop = EngineLoop(llm, model_name="tiny"); loop.start()
    async with loop.submit([(prompt_ids, params), ...]) as results:   # in a request handler
        async for choice, out in results:      # EngineOutput of engine request `choice`, as they come
            ...
    loop.stop()

Handlers never touch the engine: they send commands (add, abort) through a thread-safe queue and
receive each step's outputs on their own asyncio queue (`call_soon_threadsafe`). The thread drains
the commands, runs one `EngineCore.step()` over every running request (continuous batching across
clients), routes the outputs, and waits on the queue when nothing is left to run. Leaving the
`async with` early (a client that disconnected, a cancelled handler) aborts the unfinished
requests: the engine frees their blocks and slots at its next step. A submission whose outputs
pile up unread (a stream to a client that stopped reading: the socket's send blocks, so the
handler stops taking) is aborted by the thread once `max_backlog` outputs per request wait: the
engine does not go on generating, nor the queue on growing, for a client that is not there.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time

from kvstate.engine.outputs import EngineOutput, RequestOutput
from kvstate.engine.router import RequestRouter, fan_out

log = logging.getLogger("kvstate.server")
_STOP = object()
MAX_BACKLOG = 256  # outputs (about engine steps) per engine request waiting unread before it is aborted


class Submission:
    """One HTTP request's engine requests and the queue their outputs arrive on (asyncio side)."""

    def __init__(self, loop: "EngineLoop", request_ids: list, aio_loop: asyncio.AbstractEventLoop):
        self.engine_loop, self.request_ids = loop, request_ids
        self._aio, self._queue = aio_loop, asyncio.Queue()
        self._open = set(range(len(request_ids)))  # choices not finished yet
        self.sent = self.taken = 0  # outputs put (engine thread) and taken (asyncio side): the backlog

    def put(self, choice: int, out: EngineOutput) -> None:
        """Called on the engine thread."""
        self.sent += 1
        try:
            self._aio.call_soon_threadsafe(self._queue.put_nowait, (choice, out))
        except RuntimeError:  # the event loop is closed: the client is long gone
            pass

    async def __aenter__(self) -> "Submission":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Abort the choices still running (no-op once all finished)."""
        if self._open:
            self.engine_loop.abort([self.request_ids[c] for c in self._open])
            self._open.clear()

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, EngineOutput]:
        if not self._open:
            raise StopAsyncIteration
        choice, out = await self._queue.get()
        self.taken += 1
        if out.finished:
            self._open.discard(choice)
        return choice, out


class EngineLoop:
    def __init__(self, llm, *, model_name: str | None = None, max_backlog: int = MAX_BACKLOG):
        self.llm, self.core = llm, llm.engine
        self.max_backlog = max_backlog
        self.model_name = model_name or getattr(llm.plan, "name", None) or "kvstate"
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # engine request id -> (submission, choice); touched by the engine thread only
        self.router = RequestRouter(self.core)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stats: dict = self.core.stats()  # a snapshot taken by the thread after every step
        self.steps = 0
        self.failures = 0  # steps that raised (engine bugs): their requests failed, serving went on
        self.generated_tokens = 0  # every token sampled for a client, its request aborted or not
        # called on the engine thread after every step as observer(core, outputs, seconds): the explorer's
        # step timeline and engine view read core.last_step and the pools there, between steps
        self.step_observers: list = []

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="kvstate-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the asyncio side -------------------------------------------------------------------------
    def submit(self, prompts: list) -> Submission:
        """Queue one HTTP request's prompts, each (prompt_token_ids, SamplingParams[, snapshot hints[,
        cache_salt]]: `EngineCore.add_request`) and fanned out to its n samples (kvstate.engine.router):
        their outputs arrive tagged with the choice, prompt i's sample k being i * n + k. Must be called
        from a running event loop."""
        jobs = []
        for ids, params, *extra in prompts:
            jobs.extend((rid, choice, (ids, sample, *extra))
                        for rid, choice, sample in fan_out(f"req-{next(self._ids)}", params, len(jobs)))
        sub = Submission(self, [rid for rid, _, _ in jobs], asyncio.get_running_loop())
        self._commands.put(("add", sub, jobs))
        return sub

    def abort(self, request_ids: list) -> None:
        self._commands.put(("abort", list(request_ids)))

    def fail_all(self, message: str) -> None:
        """End every request now (a shutdown): each gets a final output with `message` (reason abort)."""
        self._commands.put(("fail", message))

    def stats(self) -> dict:
        """The engine's counters and pool occupancy after the last step, plus requests queued to the thread."""
        return {**self._stats, "num_pending": self._commands.qsize(), "num_steps": self.steps,
                "num_step_failures": self.failures}

    # -- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            # block for a command only when the engine has nothing to do
            if not self._drain(block=not self.core.has_unfinished()):
                return
            if not self.core.has_unfinished():
                continue
            try:
                started = time.perf_counter()
                outs = self.core.step()
                seconds = time.perf_counter() - started
            except Exception as exc:  # an engine bug must not stop the server: fail what was running
                log.exception("engine step failed")
                self.failures += 1
                self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                continue
            self.steps += 1
            self.generated_tokens += sum(len(out.token_ids) for out in outs)
            # observers first: a handler that sees its request finish then finds the step recorded
            for observe in self.step_observers:
                try:
                    observe(self.core, outs, seconds)
                except Exception:  # a broken view must not stop the engine
                    log.exception("step observer failed")
            self._stats = self.core.stats()  # before routing: a handler that sees its request end sees fresh stats
            for sub in self.router.route(outs):
                if sub.sent - sub.taken > self.max_backlog * len(sub.request_ids):
                    self._fail(sub, "the client stopped reading its stream: its requests were aborted")

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if `block`); False once asked to stop."""
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                self._fail_all("the server is shutting down", reason="abort")
                return False
            if cmd[0] == "add":
                sub, jobs = cmd[1], cmd[2]
                for rid, choice, (ids, params, *extra) in jobs:
                    hints, salt = (extra + [None, None])[:2]
                    try:  # admitted in turn with other clients' requests
                        self.router.add(sub, rid, choice, ids, params, group=sub.request_ids[0],
                                        snapshot_hints=hints, cache_salt=salt)
                    except Exception as exc:  # the core reports bad input at its next step; anything else fails here
                        log.exception("add_request failed")
                        sub.put(choice, _failed(rid, f"{type(exc).__name__}: {exc}"))
            elif cmd[0] == "fail":
                self._fail_all(cmd[1], reason="abort")
            else:
                self.router.abort(cmd[1])
            self._stats = self.core.stats()

    def _fail(self, sub: Submission, message: str) -> None:
        """Abort one submission's running requests (each gets a final output saying why)."""
        for rid, _, choice in self.router.abort(sub.request_ids):  # aborted before the client hears it ended
            sub.put(choice, _failed(rid, message, "abort"))

    def _fail_all(self, message: str, reason: str = "error") -> None:
        for rid, sub, choice in self.router.drop(list(self.router.routes)):
            try:  # aborted before the client hears it ended
                self.core.abort_request(rid)
            except Exception:  # the engine is already in a bad state; the request is failed either way
                log.exception("abort after a failed step")
            sub.put(choice, _failed(rid, message, reason))


def _failed(request_id, message: str, reason: str = "error") -> EngineOutput:
    """The final output of a request that could not run (finish_reason `reason`, `error` set)."""
    out = RequestOutput.failed(request_id, None, message)
    out.outputs[0].finish_reason = reason
    return EngineOutput(request_id, [], "", True, out)
