"""Large request bodies are validated on a worker thread (kvstate.server.body): the event loop answers
meanwhile, and the replies are the ones a small body gets: every malformed request of
test_bad_requests padded past OFFLOAD_BYTES is the same 4xx naming the same field."""

import asyncio
import threading

import pytest

httpx = pytest.importorskip("httpx")
from fastapi import APIRouter, FastAPI  # noqa: E402
from pydantic import BaseModel, field_validator  # noqa: E402

from kvstate.server.body import OFFLOAD_BYTES, ThreadedBodyRoute  # noqa: E402
from tests.server.test_bad_requests import BAD, CHAT, MODEL_NAME  # noqa: E402

PAD = "x" * (OFFLOAD_BYTES + 1)


def test_a_large_body_is_validated_while_the_event_loop_serves_others():
    """The body's validator waits until /ping has run: on the event loop it would wait for itself."""
    reached = threading.Event()

    class Body(BaseModel):
        text: str

        @field_validator("text")
        @classmethod
        def wait_for_ping(cls, value):
            if len(value) > OFFLOAD_BYTES and not reached.wait(5):
                raise ValueError("/ping never ran while the body was being validated")
            return value

    router = APIRouter(route_class=ThreadedBodyRoute)

    @router.post("/echo")
    async def echo(body: Body):
        return {"length": len(body.text)}

    @router.get("/ping")
    async def ping():
        reached.set()
        return {}

    app = FastAPI()
    app.include_router(router)

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
            big = asyncio.ensure_future(client.post("/echo", json={"text": PAD}))
            await asyncio.sleep(0.05)
            await client.get("/ping")
            return await big

    resp = asyncio.run(run())
    assert resp.status_code == 200 and resp.json() == {"length": len(PAD)}


def _routes(routes):
    for r in routes:  # FastAPI keeps an included router's routes in the router it includes
        yield from _routes(r.original_router.routes) if hasattr(r, "original_router") else (r,)


def test_the_servers_body_routes_all_validate_large_bodies_on_a_thread(live_server):
    posts = [r for r in _routes(live_server.app.routes)
             if "POST" in (getattr(r, "methods", None) or ()) and getattr(r, "body_field", None) is not None]
    assert len(posts) >= 4 and all(isinstance(r, ThreadedBodyRoute) for r in posts), posts


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        yield c


def _error(resp):
    return resp.status_code, resp.json()["error"]["param"]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_a_large_bad_request_gets_the_small_ones_reply(client, i):
    path, body, status, param = BAD[i]
    if isinstance(body, bytes):  # leading whitespace: the same JSON (or the same malformed text)
        resp = client.post(path, content=b" " * (OFFLOAD_BYTES + 1) + body,
                           headers={"content-type": "application/json"})
        assert resp.status_code == status, resp.text[:300]
        return
    resp = client.post(path, json={**body, "user": PAD} if isinstance(body, dict) else body)
    assert _error(resp) == (status, param), resp.text[:300]


def test_a_large_good_request_is_served(client):
    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "user": PAD})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2


def test_content_parts_are_capped_before_they_are_validated(client):
    parts = [{"type": "text", "text": ""}] * 5000
    resp = client.post(CHAT, json={"model": MODEL_NAME, "messages": [{"role": "user", "content": parts}]})
    assert _error(resp) == (400, "messages") and "4096 content parts" in resp.json()["error"]["message"]


def test_a_large_body_with_too_many_arrays_and_objects_is_refused_before_it_is_parsed(client):
    from kvstate.server.body import MAX_CONTAINERS

    resp = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [[1]] * (MAX_CONTAINERS + 1)})
    assert _error(resp) == (400, None) and "JSON arrays and objects" in resp.json()["error"]["message"]


@pytest.mark.parametrize("prompt", [[1] + ["a"] * 5000, [[1, "a"] + ["b"] * 5000], ["a"] * 5000])
def test_validation_stops_at_the_first_bad_item_or_a_count(prompt):
    """Pydantic made one error object per bad item (1.5M of them: a minute on the event loop)."""
    from pydantic import ValidationError

    from kvstate.server.schemas import CompletionRequest

    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": prompt})
    assert info.value.error_count() == 1 and info.value.errors()[0]["loc"][0] == "prompt"
