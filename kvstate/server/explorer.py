"""The explorer's API: the numbers behind the live page served at `/` (kvstate/server/static).

    app = create_app(loop, routers=[explorer.router])

Routes under /explorer/api (kept out of the OpenAPI schema: they serve the page, not clients):

    GET  models     bundled configs and the served model
    GET  memory     ?model=NAME|loaded&context=N: `kvstate memory --json --layers` at N, the three
                    curves (MHA / GQA on every layer, the actual hybrid), each layer's cache at N
    POST memory     {"config": {...config.json...}, "context": N}: the same for an uploaded config
    GET  engine     ?since=STEP: pools, each request's blocks and slot, step records after STEP
    POST cache      {"prompt": text, "max_tokens": k}: run it; positions per step with the cache
                    (the engine's own steps) and without (the whole prefix recomputed each step)
    POST recall     {"task": "needle"|"phonebook", "size": n, "seed": s}: candidates' probabilities

Spec 002's lessons (the decay slider and the model's own horizons, recall side by side, the
real-scale prefill/decode timeline, cache on/off in time) live in `explorer_lessons`, whose routes
this router includes (decay, gates, compare, scale, scale/run, cache/time).

The router's lifespan hangs a `StepRecorder` on the app's engine loop (`step_observers`), so the
timeline starts with the server. Every bad input is a 400 with the server's error JSON (a config
field the planner refuses names it as `param`, e.g. "config.num_hidden_layers"). The planner,
tokenizing and the recall task's prompt run on the explorer's own thread (`explorer_pool`), so the
event loop keeps serving and /v1 never waits for a thread an explorer call holds.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kvstate.errors import ConfigFieldError, KvstateError
from kvstate.server import explorer_pool
from kvstate.server.body import ThreadedBodyRoute
from kvstate.server.explorer_engine import StepRecorder, run_greedy, served_loop
from kvstate.server.protocol import ApiError
from kvstate.server.schemas import lone_surrogate

MAX_CACHE_TOKENS = 64


def recorder(app) -> StepRecorder | None:
    """The app's step recorder, hung on its engine loop on first use (None without an engine)."""
    loop = getattr(app.state, "engine_loop", None)
    if loop is None:
        return None
    rec = getattr(app.state, "explorer_recorder", None)
    if rec is None:
        rec = app.state.explorer_recorder = StepRecorder()
        rec.view = rec.snapshot(loop.core)  # before the first step: the engine thread has nothing to do yet
        loop.step_observers.append(rec)
    return rec


@contextlib.asynccontextmanager
async def _lifespan(app):
    recorder(app)
    yield


router = APIRouter(prefix="/explorer/api", include_in_schema=False, lifespan=_lifespan,
                   route_class=ThreadedBodyRoute)


def _bad(exc: Exception, param: str | None = None) -> ApiError:
    return ApiError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__, param=param)


def _loaded_plan(request: Request):
    loop = getattr(request.app.state, "engine_loop", None)
    return None if loop is None else loop.core.plan


@router.get("/models")
async def models(request: Request):
    from kvstate.config.reader import bundled_names

    loop = getattr(request.app.state, "engine_loop", None)
    return {"bundled": bundled_names(), "loaded": None if loop is None else loop.model_name}


def _memory(request: Request, model: str | None, config: dict | None, context: int | None) -> dict:
    from kvstate.server.explorer_memory import memory_view, plan_for

    try:
        plan = plan_for(model, config, _loaded_plan(request))
    except ConfigFieldError as exc:
        raise _bad(exc, f"config.{exc.field}" if config is not None and exc.field else None) from None
    except KvstateError as exc:
        raise _bad(exc) from None
    except Exception as exc:  # an uploaded config the adapters trip over: the user's file, not a server fault
        raise ApiError(f"cannot read this config.json: {type(exc).__name__}: {exc}") from None
    try:
        return memory_view(plan, context=context)
    except KvstateError as exc:
        raise _bad(exc, "context" if str(exc).startswith("context") else None) from None


@router.get("/memory")
async def memory(request: Request, model: str = "qwen3.5-0.8b", context: int | None = None):
    return await explorer_pool.run(request.app, lambda: _memory(request, model, None, context))


class ConfigUpload(BaseModel):
    config: dict[str, Any]
    context: int | None = None


@router.post("/memory")
async def memory_upload(body: ConfigUpload, request: Request):
    return await explorer_pool.run(request.app, lambda: _memory(request, None, body.config, body.context))


@router.get("/engine")
async def engine(request: Request, since: int = -1):
    rec = recorder(request.app)
    if rec is None:
        return {"available": False}
    loop = request.app.state.engine_loop
    return {"available": True, "model": loop.model_name, "view": rec.view, "timeline": rec.timeline(since)}


class CacheRun(BaseModel):
    prompt: str = Field(min_length=1, max_length=20000)
    max_tokens: int = Field(default=8, ge=1, le=MAX_CACHE_TOKENS)


def _engine_parts(request: Request):
    return served_loop(request), recorder(request.app)


@router.post("/cache")
async def cache_run(body: CacheRun, request: Request):

    loop, rec = _engine_parts(request)
    if lone_surrogate(body.prompt):
        raise ApiError("the prompt holds a lone UTF-16 surrogate (such as \\ud800): not valid text", param="prompt")
    ids = await explorer_pool.run(request.app, lambda: loop.core.tokenizer.encode(body.prompt))
    room = loop.core.max_model_len - body.max_tokens
    if not ids or len(ids) > room:
        raise ApiError(f"the prompt is {len(ids)} tokens; it must be 1 to {room} with {body.max_tokens} to generate")
    final, steps, request_id = await run_greedy(loop, rec, ids, body.max_tokens)
    text = final.outputs[0].text if final.outputs else ""
    return {"prompt_tokens": len(ids), "output_tokens": len(final.outputs[0].token_ids), "text": text,
            "request_id": request_id, "steps": steps,
            "with_cache_total": sum(s["with_cache"] for s in steps),
            "without_cache_total": sum(s["without_cache"] for s in steps)}


class RecallRun(BaseModel):
    task: Literal["needle", "phonebook"] = "needle"
    size: int = Field(default=20, ge=1, le=2000)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    depth: float | None = Field(default=None, ge=0, le=1)


@router.post("/recall")
async def recall(body: RecallRun, request: Request):
    from kvstate.server import explorer_recall

    loop, _ = _engine_parts(request)
    prompt, answer, candidates = await explorer_pool.run(
        request.app, lambda: explorer_recall.example(body.task, body.size, body.seed, body.depth))
    prompt_tokens, rows = await explorer_pool.run(request.app, lambda: explorer_recall.score(
        loop.core.model, loop.core.tokenizer, prompt, candidates, loop.core.max_model_len))
    return {"task": body.task, "size": body.size, "seed": body.seed, "prompt": prompt, "answer": answer,
            "prompt_tokens": prompt_tokens, "candidates": rows}


# spec 002's lessons (decay slider and gates, recall side by side, real-scale timing, cache time)
from kvstate.server.explorer_lessons import router as _lessons  # noqa: E402 (after this router's own routes)

router.include_router(_lessons)
