"""The gate in front of every route of `kvstate serve`: the API key, then the body size (pure ASGI).

    app.add_middleware(Gate, limits=ServerLimits(), api_key="secret")

With an API key, /v1/*, the tokenizer's routes and /explorer/api/* need `Authorization: Bearer KEY` (else a 401 in
OpenAI's error JSON, compared in constant time); /metrics needs `metrics_key` (by default the
same key: its counters tell who uses the server how much; a scraper may get a key of its own);
/health, the explorer's page and the OpenAPI document stay open. A body declared larger
than `limits.max_body_bytes` is a 413 before any of it is parsed or kept; one without
Content-Length is cut off with a 413 once it grows past the limit. Either way the rest of the
body is read and dropped first (up to DRAIN_BYTES; past that the connection just closes): a
server that closes on unread data makes the kernel reset the connection, and the client may
never see the 413 it was sent. Streams pass untouched.
"""

from __future__ import annotations

import hmac
import json

from starlette.exceptions import HTTPException

from kvstate.server.limits import ServerLimits
from kvstate.server.protocol import error_body

PROTECTED = ("/v1/", "/explorer/api/", "/tokenize/", "/detokenize/", "/tokenizer_info/")
DRAIN_BYTES = 256 << 20  # the most of a refused body read (and dropped) so that the client sees the 413


async def _drain(receive, seen: int) -> None:
    """Read and drop the rest of a request body (`seen` bytes of it read so far), up to DRAIN_BYTES."""
    while seen <= DRAIN_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class BodyTooLarge(HTTPException):
    """Raised from `receive` while a body without Content-Length streams in past the limit (FastAPI
    re-raises an HTTPException met while reading the body; the app's handler answers it)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes (kvstate serve --max-body-bytes)")


def safe_json(payload) -> bytes:
    """JSON bytes that a lone surrogate (a client's "\\ud800" echoed back) cannot break."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


async def _reply(send, status: int, body: dict, headers: dict | None = None) -> None:
    raw = safe_json(body)
    extra = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": raw})


class Gate:
    def __init__(self, app, limits: ServerLimits, api_key: str | None = None, metrics_key: str | None = None):
        self.app, self.limits = app, limits
        self.api_key = api_key.encode() if api_key else None
        metrics_key = metrics_key or api_key
        self.metrics_key = metrics_key.encode() if metrics_key else None

    def _authorized(self, scope) -> bool:
        path = scope.get("path", "")
        if path == "/metrics":
            key = self.metrics_key
        elif any(path.startswith(p) or path == p.rstrip("/") for p in PROTECTED):
            key = self.api_key
        else:
            return True
        if key is None:
            return True
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self._authorized(scope):
            return await _reply(send, 401, error_body(
                "Incorrect or missing API key: send it as 'Authorization: Bearer KEY' (kvstate serve --api-key)",
                "invalid_request_error", None, "invalid_api_key"), {"www-authenticate": "Bearer"})
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await _reply(send, 400, error_body("the Content-Length header is not a number"))
                if declared > limit:  # dropped unparsed, then answered
                    if (b"expect", b"100-continue") not in scope.get("headers", ()):
                        await _drain(receive, 0)  # (a client waiting for 100 Continue has sent none of it)
                    return await _reply(send, 413, error_body(
                        f"the request body is {declared} bytes, more than {limit} (kvstate serve --max-body-bytes)",
                        "invalid_request_error", None, "request_too_large"))
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _drain(receive, seen)
                    raise BodyTooLarge(limit)
            return message

        return await self.app(scope, counted, send)
