"""`/metrics`: Prometheus text (prometheus-client) for one app, in its own registry (no globals).

Counters kept by the server: requests by route and status code, prompt tokens; generated tokens
are the engine loop's count (every token sampled, the requests a client left included).
Gauges read at scrape time from the engine loop's last snapshot of `EngineCore.stats()`: every
numeric field becomes `kvstate_<field>` (requests running and waiting, KV blocks and state slots
used and total, bytes in use, and whatever the engine adds later, such as prefix-cache hits),
plus the requests queued to the engine thread (`kvstate_num_pending`). The fields that only grow
(steps, prefix-cache lookups and hits, snapshots taken, draft tokens: `_cumulative`) are typed
counter, named `..._total` as Prometheus wants, so that rate() and resets work on them.
"""

from __future__ import annotations

import re

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

router = APIRouter()
_COUNTED = ("num_steps", "num_step_failures", "snapshots_taken", "snapshots_evicted")
_COUNTED_PREFIXES = ("prefix_hits", "prefix_lookups", "prefix_prompt_tokens", "prefix_cached_tokens", "spec_num_")


def _cumulative(key: str) -> bool:
    """Whether an engine stats field only grows (a counter), not a level (a gauge)."""
    return key in _COUNTED or key.startswith(_COUNTED_PREFIXES)


class _EngineCollector:
    def __init__(self, loop):
        self.loop = loop

    def collect(self):
        yield CounterMetricFamily("kvstate_generation_tokens", "tokens generated (aborted requests' included)",
                                  value=self.loop.generated_tokens)
        for key, value in sorted(self.loop.stats().items()):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = "kvstate_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
                family = CounterMetricFamily if _cumulative(key) else GaugeMetricFamily
                yield family(name, f"engine: {key.replace('_', ' ')}", value=value)


class ServerMetrics:
    def __init__(self, loop):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvstate_http_requests", "HTTP requests answered, by route and status code",
                                ["route", "code"], registry=self.registry)
        self.prompt_tokens = Counter("kvstate_prompt_tokens", "prompt tokens of accepted requests",
                                     registry=self.registry)
        self.registry.register(_EngineCollector(loop))

    def text(self) -> bytes:
        return generate_latest(self.registry)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    return Response(request.app.state.metrics.text(), media_type=CONTENT_TYPE_LATEST)


class CountRequests:
    """ASGI middleware counting every answered request by route template (not the raw path, so the
    labels stay bounded). Pure ASGI: it leaves streams and their cancellation alone."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = getattr(scope.get("route"), "path", None) or "other"
            self.metrics.requests.labels(path, str(status["code"])).inc()
