"""Request bodies validated off the event loop: the route class of the JSON endpoints.

    router = APIRouter(route_class=ThreadedBodyRoute)

FastAPI parses a JSON body and validates it into the endpoint's pydantic model on the event loop.
Within --max-body-bytes (8 MB) that was up to a minute of work (1.5M bad token ids: one error
object each), during which /health and every other client waited. A body over OFFLOAD_BYTES is
instead parsed and validated on a worker thread, as FastAPI would (json.loads, then the model),
and FastAPI gets the finished model (an instance it does not validate again); what the validation
refuses comes back as `BodyInvalid`, which the app answers as FastAPI's own validation errors:
the same 400 naming the field. The event loop runs between the steps, not during them: the JSON
parser and pydantic hold the interpreter for each whole call. So each call is bounded: a large
body may hold at most MAX_CONTAINERS arrays and objects (counted from its '[' and '{' bytes before
it is parsed: 600k of them took 1.3 s to parse), and the schema bounds validation (`schemas`:
lists counted before their items, a prompt validated only as its own form, the first bad item
ends a list).
"""

from __future__ import annotations

import asyncio
import json
import weakref

import anyio
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

OFFLOAD_BYTES = 64 << 10  # smaller bodies validate in about a millisecond: not worth a thread
MAX_CONTAINERS = 50_000  # a large body's arrays and objects: parsing 600k of them held the interpreter 1.3 s


_LIMITERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its limiter


def _one_at_a_time() -> anyio.CapacityLimiter:
    """Large bodies validate one at a time: each call holds the interpreter, and the event loop then
    waits for one thread, not for six that take turns before it (six at once held /health 1.2 s)."""
    loop = asyncio.get_running_loop()
    if loop not in _LIMITERS:
        _LIMITERS[loop] = anyio.CapacityLimiter(1)
    return _LIMITERS[loop]


class BodyInvalid(HTTPException):
    """A body the worker thread's validation refused; `errors` as FastAPI's RequestValidationError has them."""

    def __init__(self, errors: list[dict]):
        super().__init__(400, "the request body is invalid")
        self.errors = errors


class _ThreadedRequest(Request):
    def __init__(self, request: Request, model: type[BaseModel]):
        super().__init__(request.scope, request.receive, request._send)
        self.model = model

    async def json(self):
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) <= OFFLOAD_BYTES:
                return await super().json()
            self._json = await anyio.to_thread.run_sync(self._validate, body, limiter=_one_at_a_time())
        return self._json

    def _validate(self, body: bytes) -> BaseModel:
        containers = body.count(b"[") + body.count(b"{")  # an upper bound: brackets inside strings count too
        if containers > MAX_CONTAINERS:
            raise BodyInvalid([{"type": "too_many_containers", "loc": ("body",),
                                "msg": f"more than {MAX_CONTAINERS} JSON arrays and objects ('[' and '{{' "
                                       f"characters: {containers}); no request needs that many"}])
        try:
            value = json.loads(body)
        except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
            raise BodyInvalid([{"type": "json_invalid", "loc": ("body",), "msg": str(exc)}]) from None
        try:
            return self.model.model_validate(value)
        except ValidationError as exc:
            errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False, include_input=False)]
        del value  # a refused body's objects are freed here, not on the event loop
        raise BodyInvalid(errors)


class ThreadedBodyRoute(APIRoute):
    """An APIRoute whose pydantic-model body, when large, is validated on a worker thread."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        model = getattr(getattr(self.body_field, "field_info", None), "annotation", None)
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def threaded(request: Request):
            return await handler(_ThreadedRequest(request, model))

        return threaded
