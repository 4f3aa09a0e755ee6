"""The FastAPI application of `kvstate serve`: routes, error replies, the explorer's mount points.

    app = create_app(EngineLoop(llm, model_name="tiny"))      # or create_app(llm): a loop is made
    app = create_app(loop, routers=[explorer.router])         # more APIRouters (the explorer's API)

The OpenAI routes live in `openai_routes`, the tokenizer's in `tokenizer_routes`; this module wires
them with /health and /metrics, turns every error into OpenAI's error JSON with a 4xx code (a
malformed body is a 400, as OpenAI answers, not FastAPI's 422), and serves the explorer's static
files at `/` (mounted last, so every API route is matched first; a GET of an API route's path is
still a 405, not the static 404). The `gate.Gate` in front checks the API key and the body size;
replies are JSON that a client's lone surrogate cannot break. The app starts the engine loop on
startup and stops it on shutdown.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from kvstate.server.body import BodyInvalid
from kvstate.server.engine_loop import EngineLoop
from kvstate.server.gate import Gate, safe_json
from kvstate.server.limits import ServerLimits
from kvstate.server.protocol import ApiError, error_body

STATIC_DIR = Path(__file__).parent / "static"
log = logging.getLogger("kvstate.server")


class SafeJSONResponse(JSONResponse):
    def render(self, content) -> bytes:
        return safe_json(content)


def create_app(engine, *, model_name: str | None = None, routers=(), static_dir: Path | None = STATIC_DIR,
               api_key: str | None = None, limits: ServerLimits | None = None,
               metrics_key: str | None = None) -> FastAPI:
    """The app over `engine`: an `EngineLoop`, or an `LLM` (a loop is made for it, named `model_name`).
    `routers`: extra APIRouters to include (they see the loop as `request.app.state.engine_loop`);
    `static_dir`: mounted at `/` when it exists (None: no static files); `api_key`: required as a
    bearer token by /v1 and the explorer's API; `metrics_key`: the one /metrics needs (None: `api_key`);
    `limits`: what one request may ask (`ServerLimits`; a request's sequences are held to half the
    engine's max_num_seqs, so that one request never takes every running place)."""
    from kvstate.server import metrics, openai_routes, tokenizer_routes

    loop = engine if isinstance(engine, EngineLoop) else EngineLoop(engine, model_name=model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="kvstate", description="OpenAI-compatible server over the kvstate engine "
                  "(paged KV for full attention, fixed state slots for linear layers)", lifespan=lifespan,
                  default_response_class=SafeJSONResponse)
    app.state.engine_loop = loop
    limits = limits or ServerLimits()
    seqs = getattr(getattr(getattr(loop.core, "scheduler", None), "config", None), "max_num_seqs", None)
    if seqs is not None:
        limits = replace(limits, max_sequences=min(limits.max_sequences, max(1, seqs // 2)))
    app.state.limits = limits
    app.state.metrics = metrics.ServerMetrics(loop)
    app.add_middleware(Gate, limits=limits, api_key=api_key, metrics_key=metrics_key)
    app.add_middleware(metrics.CountRequests, metrics=app.state.metrics)  # outermost: counts the gate's 401/413 too
    _error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(tokenizer_routes.router)
    app.include_router(metrics.router)
    for router in routers:
        include_router(app, router)
    if static_dir is not None and Path(static_dir).is_dir():
        app.mount("/", StaticFiles(directory=static_dir, html=True), name="static")
    return app


def include_router(app: FastAPI, router) -> None:
    """Mount another APIRouter (e.g. `kvstate.server.explorer.router`) before the static files, whose
    catch-all mount at `/` would otherwise shadow it."""
    static = [r for r in app.router.routes if getattr(r, "name", None) == "static"]
    for r in static:
        app.router.routes.remove(r)
    app.include_router(router)
    app.router.routes.extend(static)


def _allowed_methods(app: FastAPI, scope) -> set[str]:
    """The methods an API route (not the static files) takes at this request's path (none: a true 404)."""
    routes = [r for r in app.router.routes if getattr(r, "name", None) != "static"]
    return {m for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if any(r.matches({**scope, "method": m})[0] == Match.FULL for r in routes)}


def _invalid_body(request: Request, errors) -> SafeJSONResponse:
    """A body that fails its schema: a 400 naming the field (not FastAPI's 422)."""
    first = errors[0] if errors else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        message, param = "the request body is not valid JSON", None
    elif first.get("type") == "extra_forbidden":  # a field this endpoint does not know would be dropped
        param = where[0] if where else None
        message = f"{'.'.join(where)}: unknown field; {request.url.path} does not support it"
    else:
        message = f"{'.'.join(where) or 'body'}: {first.get('msg', 'invalid value')}"
        param = where[0] if where else None
    return SafeJSONResponse(error_body(message, "invalid_request_error", param), status_code=400)


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return SafeJSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError):
        return _invalid_body(request, exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if isinstance(exc, BodyInvalid):  # a large body, validated on a worker thread
            return _invalid_body(request, exc.errors)
        if exc.status_code in (404, 405):  # the static files at / answer every GET (an API path is a 405
            # there) and refuse every other method (a path nothing serves is a 404, not their 405)
            allowed = _allowed_methods(app, request.scope)
            if not allowed and exc.status_code == 405:
                return SafeJSONResponse(error_body(f"no route {request.url.path}", "not_found_error"),
                                        status_code=404)
            if allowed and request.method not in allowed:
                return SafeJSONResponse(error_body(f"method {request.method} is not allowed here; use "
                                                   f"{', '.join(sorted(allowed))}"), status_code=405,
                                        headers={"Allow": ", ".join(sorted(allowed))})
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return SafeJSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                                headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # an engine bug: say so, keep serving
        log.exception("internal error on %s", request.url.path)
        return SafeJSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "internal_error"),
                                status_code=500)
