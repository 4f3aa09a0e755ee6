"""uvicorn as `kvstate serve` runs it: an idle timeout on incomplete requests, and a shutdown that
ends the engine's work first.

    server = ServeServer(uvicorn.Config(app, http=IdleTimeoutProtocol, timeout_graceful_shutdown=3),
                         engine_loop=app.state.engine_loop, idle_timeout=15)
    server.run(sockets=[sock])

uvicorn closes a connection idle *between* requests (`timeout_keep_alive`) but not one that never
finishes its request head or body: 300 silent sockets held 300 file descriptors until the
process ran out. `IdleTimeoutProtocol` closes a connection that sent nothing for `idle_timeout`
seconds while its request head or body is incomplete (a client waiting for its answer, a stream
being read, is left alone). On SIGTERM `ServeServer` first fails every engine request ("the
server is shutting down": streams end with that and [DONE], the others are a 503), so uvicorn's
graceful wait ends in a moment; `timeout_graceful_shutdown` then cancels whatever still hangs.
"""

from __future__ import annotations

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvstate.server.limits import DEFAULT_IDLE_TIMEOUT


class IdleTimeoutProtocol(H11Protocol):
    """h11 with an idle timeout on the request side (`idle_timeout`, set by the server's config)."""

    idle_timeout: float = DEFAULT_IDLE_TIMEOUT

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._last_data = self.loop.time()
        self._idle_timer = self.loop.call_later(self.idle_timeout, self._check_idle)

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        self._idle_timer.cancel()
        super().connection_lost(exc)

    def _check_idle(self) -> None:
        if self.transport.is_closing():
            return
        waited = self.loop.time() - self._last_data
        stalled = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)  # a head or a body not finished
        if stalled and waited >= self.idle_timeout:
            self.transport.close()  # the app, if it was reading the body, sees a disconnect
            return
        self._idle_timer = self.loop.call_later(max(self.idle_timeout - waited, 0.5), self._check_idle)


def protocol_with(idle_timeout: float) -> type[IdleTimeoutProtocol]:
    """The protocol class for uvicorn.Config(http=...), with this idle timeout."""
    return type("IdleTimeoutProtocol", (IdleTimeoutProtocol,), {"idle_timeout": float(idle_timeout)})


class ServeServer(uvicorn.Server):
    """uvicorn's server that fails the engine's requests as soon as a shutdown starts."""

    def __init__(self, config: uvicorn.Config, engine_loop):
        super().__init__(config)
        self.engine_loop = engine_loop

    async def shutdown(self, sockets=None) -> None:
        self.engine_loop.fail_all("the server is shutting down")
        await super().shutdown(sockets)
