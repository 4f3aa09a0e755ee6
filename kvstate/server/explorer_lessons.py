"""The explorer's routes for spec 002's lessons, included in `explorer.router` (/explorer/api/...):

    GET  decay          the scalar cartoon's slider stops: decay -> tokens keeping >= 10% of the weight
    POST gates          {"prompt", "layer"}: every linear layer's per-head decays and memory horizons on
                        the prompt, and the prompt fed token by token (KV cells, one layer's state slot)
    POST compare        {"task", "size", "seed", "other"}: one recall prompt scored by the served model
                        and a second one, a shipped model's name (default: the other) or the served
                        model's (no path: a client never learns what the server's disk holds)
    GET  scale          the real-scale prefill/decode scenario from a bench result (null until one is given)
    POST scale          a `kvstate bench engine --json` result (uploaded): its scenario
    POST scale/run      start one bench run (a subprocess of GBs), only on a server started with
                        --explorer-bench-run (else a 403); GET scale reports it
    POST cache/time     {"prompt", "max_tokens"}: the engine's steps replayed with the cache, and a full
                        forward without it at each step, both timed

Every model forward runs on the explorer's own thread (`explorer_pool`: never on the event loop, never
on the threads /v1 needs), on bounded input: at most MAX_PROMPT_TOKENS tokens fed one by one, MAX_TIMED_TOKENS
generated, MAX_RECOMPUTED positions in all the cache-off forwards of one timing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from kvstate.errors import KvstateError
from kvstate.shipped import SHIPPED
from kvstate.server import explorer_pool
from kvstate.server.explorer_engine import served_loop
from kvstate.server.protocol import ApiError
from kvstate.server.schemas import lone_surrogate

MAX_PROMPT_TOKENS = 64  # the gates panel feeds the prompt one token at a time
MAX_TIMED_PROMPT = 256
MAX_TIMED_TOKENS = 64
MAX_RECOMPUTED = 8192  # positions of all the cache-off forwards of one timing

@contextlib.asynccontextmanager
async def _lifespan(app):
    yield
    pool = getattr(app.state, "explorer_pool", None)
    if pool is not None:
        pool.close()
    run = getattr(app.state, "explorer_bench_run", None)
    if run is not None:
        run.stop()


router = APIRouter(include_in_schema=False, lifespan=_lifespan)  # serves the page, not clients


def _check_text(prompt: str) -> None:
    """A lone surrogate ("\\ud800" in JSON) is not text a tokenizer takes: a 400, not a 500."""
    if lone_surrogate(prompt):
        raise ApiError("the prompt holds a lone UTF-16 surrogate (such as \\ud800): not valid text", param="prompt")


async def _in_thread(request: Request, fn):
    return await explorer_pool.run(request.app, fn)


@router.get("/decay")
async def decay():
    from kvstate.server.explorer_gates import THRESHOLD, cartoon_table

    return {"threshold": THRESHOLD, "stops": cartoon_table()}


class GatesRun(BaseModel):
    prompt: str = Field(min_length=1, max_length=4000)
    layer: int | None = Field(default=None, ge=0)


@router.post("/gates")
async def gates(body: GatesRun, request: Request):
    from kvstate.server import explorer_gates as eg

    loop = served_loop(request)
    core = loop.core
    _check_text(body.prompt)
    all_ids = await _in_thread(request, lambda: core.tokenizer.encode(body.prompt))
    ids = all_ids[:MAX_PROMPT_TOKENS]
    if not ids:
        raise ApiError("the prompt has no tokens")
    tokens = [core.tokenizer.decode([t], skip_special_tokens=False) for t in ids]

    def run():
        layers = eg.decays(core.model, ids)
        linear = [i for i, c in enumerate(core.runner.caches) if c.state is not None]
        layer = body.layer if body.layer is not None else (layers[0]["layer"] if layers else
                                                            (linear[0] if linear else None))
        if layer is not None and layer not in linear:
            raise KvstateError(f"layer {layer} has no state (linear layers: {linear})")
        walk = eg.walk(core.model, ids, layer) if layer is not None else []
        return layers, layer, walk, linear
    layers, layer, walk, linear = await _in_thread(request, run)
    spec = core.runner.cache_spec
    attention = [e.layer for e in spec.entries if e.kv is not None]
    return {"model": loop.model_name, "layer_string": core.plan.layer_string, "tokens": tokens,
            "truncated": len(all_ids) > MAX_PROMPT_TOKENS,
            "threshold": eg.THRESHOLD, "layers": layers, "state_layer": layer, "state_layers": linear,
            "state_shape": eg.state_shape(core.model, layer) if layer is not None else [],
            "attention_layers": attention, "kv_bytes_per_token": spec.kv_bytes_per_token,
            "state_bytes": spec.state_bytes, "walk": walk}


class CompareRun(BaseModel):
    task: Literal["needle", "phonebook"] = "phonebook"
    size: int = Field(default=16, ge=1, le=256)
    seed: int = Field(default=0, ge=0, le=2**31 - 1)
    other: str | None = Field(default=None, max_length=500)


def _models(app):
    from kvstate.server.explorer_compare import ModelCache

    cache = getattr(app.state, "explorer_models", None)
    if cache is None:
        cache = app.state.explorer_models = ModelCache()
    return cache


@router.post("/compare")
async def compare(body: CompareRun, request: Request):
    from kvstate.server import explorer_compare as ec
    from kvstate.server import explorer_recall

    loop = served_loop(request)
    core = loop.core
    other = (body.other or "").strip() or ec.default_other(core.plan)
    if other == loop.model_name and ec.checkpoint_dir(core.plan) is not None:
        other = str(ec.checkpoint_dir(core.plan))
    elif other not in SHIPPED:
        raise ApiError(f"other must be a shipped model ({', '.join(SHIPPED)}) or the served model "
                       f"({loop.model_name})", param="other")
    try:
        prompt, answer, candidates = explorer_recall.example(body.task, body.size, body.seed)
    except KvstateError as exc:
        raise ApiError(str(exc)) from None
    models = _models(request.app)

    def run():
        served = ec.side(core.model, core.tokenizer, core.plan, loop.model_name, body.task, body.size, prompt,
                         candidates, core.max_model_len)
        try:
            model, tok, plan = models.get(other)
        except (OSError, ValueError) as exc:
            raise KvstateError(f"{other}: cannot load it: {exc}") from None
        limit = plan.max_position_embeddings or core.max_model_len
        return served, ec.side(model, tok, plan, other, body.task, body.size, prompt, candidates, limit)
    served, second = await _in_thread(request, run)
    return {"task": body.task, "size": body.size, "seed": body.seed, "prompt": prompt, "answer": answer,
            "models": [served, second]}


def _bench_runner(app):
    from kvstate.server.explorer_scale import BenchRun

    run = getattr(app.state, "explorer_bench_run", None)
    if run is None:
        run = app.state.explorer_bench_run = BenchRun(getattr(app.state, "explorer_bench_command", None))
    return run


@router.get("/scale")
async def scale(request: Request):
    from kvstate.server.explorer_scale import scenario

    run = _bench_runner(request.app)
    if run.result is not None:
        request.app.state.explorer_bench = run.result
        run.result = None
    bench = getattr(request.app.state, "explorer_bench", None)
    try:
        return {"run": run.state, "scenario": None if bench is None else scenario(bench)}
    except KvstateError as exc:
        return {"run": run.state, "scenario": None, "error": str(exc)}


class BenchUpload(BaseModel):
    bench: dict[str, Any]


@router.post("/scale")
async def scale_upload(body: BenchUpload, request: Request):
    from kvstate.server.explorer_scale import scenario

    try:
        figures = scenario(body.bench)
    except (KvstateError, TypeError, ValueError) as exc:
        raise ApiError(str(exc).splitlines()[0] if str(exc) else "not a bench result") from None
    request.app.state.explorer_bench = body.bench
    return {"run": _bench_runner(request.app).state, "scenario": figures}


@router.post("/scale/run")
async def scale_run(request: Request):
    if not getattr(request.app.state, "explorer_bench_runs", False):
        raise ApiError("this server does not run benchmarks (start it with kvstate serve --explorer-bench-run); "
                       "upload a `kvstate bench engine --json` result instead", status=403, type="permission_error")
    return {"run": _bench_runner(request.app).start()}


class TimedRun(BaseModel):
    prompt: str = Field(min_length=1, max_length=20000)
    max_tokens: int = Field(default=32, ge=1, le=MAX_TIMED_TOKENS)


@router.post("/cache/time")
async def cache_time(body: TimedRun, request: Request):
    from kvstate.server.explorer_engine import run_greedy
    from kvstate.server.explorer_timing import on_off_ms

    loop = served_loop(request)
    rec = getattr(request.app.state, "explorer_recorder", None)
    if rec is None:
        raise ApiError("the explorer's step recorder is not running", status=409)
    _check_text(body.prompt)
    ids = await _in_thread(request, lambda: loop.core.tokenizer.encode(body.prompt))
    room = min(MAX_TIMED_PROMPT, loop.core.max_model_len - body.max_tokens)
    if not ids or len(ids) > room:
        raise ApiError(f"the prompt is {len(ids)} tokens; it must be 1 to {room} with {body.max_tokens} to generate")
    n = body.max_tokens
    recomputed = n * len(ids) + n * (n - 1) // 2  # positions the cache-off side runs, over all its steps
    if recomputed > MAX_RECOMPUTED:
        raise ApiError(f"without the cache this recomputes {recomputed:,} positions (a {len(ids)}-token prompt, "
                       f"{n} tokens); keep it under {MAX_RECOMPUTED:,}: a shorter prompt or fewer tokens")
    final, steps, _ = await run_greedy(loop, rec, ids, n)
    out_ids = list(final.outputs[0].token_ids)
    # the last generated token is never fed back: the steps cover prompt + out_ids[:-1]
    timed = await _in_thread(request, lambda: on_off_ms(loop.core.model, ids + out_ids, steps))
    rows = [{**s, "engine_ms": s.pop("ms"), "with_cache_ms": on, "without_cache_ms": off}
            for s, (on, off) in zip(steps, timed)]
    return {"prompt_tokens": len(ids), "output_tokens": len(out_ids), "text": final.outputs[0].text,
            "steps": rows, "with_cache_total": sum(s["with_cache"] for s in steps),
            "without_cache_total": sum(s["without_cache"] for s in steps),
            "with_cache_ms": sum(r["with_cache_ms"] for r in rows),
            "without_cache_ms": sum(r["without_cache_ms"] for r in rows),
            "engine_ms": sum(r["engine_ms"] for r in rows)}
