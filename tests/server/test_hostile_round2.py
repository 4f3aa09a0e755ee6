"""Issue #41 (hostile clients, round 2), the parts checked without a server process: what one request
may make the engine do per token (stop ids in a set, capped; stop strings capped), sampling values
that underflow float32 (numpy's float32 says which), chat message ends computed for the last few
messages only, a request's share of the running places, unread outputs aborting their requests,
a shutdown ending every request at once, cumulative metrics typed counter (prometheus-client's own
parser reads them), /metrics behind the key, and the explorer: its own thread (a /v1 request is
answered while the explorer thread is held), bench runs only with the flag, compare by name only,
uploaded figures finite."""

import asyncio
import json
import math
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvstate.engine import params as P
from kvstate.engine.params import SamplingParams
from kvstate.errors import KvstateError
from kvstate.server.engine_loop import EngineLoop
from tests.server.test_engine_loop import FakeCore

httpx = pytest.importorskip("httpx")


# -- per token and per request bounds --------------------------------------------------------------
def test_stop_ids_are_capped_and_looked_up_in_a_set():
    with pytest.raises(KvstateError, match="stop_token_ids takes at most"):
        SamplingParams(stop_token_ids=[0] * 3_000_000)
    p = SamplingParams(stop_token_ids=list(range(P.MAX_STOP_TOKEN_IDS)))
    assert p.stop_token_set == frozenset(range(P.MAX_STOP_TOKEN_IDS))
    assert SamplingParams(stop_token_ids=[5, 5]).for_sample(1).stop_token_set == {5}  # kept by replace()


def test_stop_strings_are_capped_and_deduplicated():
    assert SamplingParams(stop=["a", "b", "a"]).stop == ["a", "b"]
    with pytest.raises(KvstateError, match="at most"):
        SamplingParams(stop=[str(i) for i in range(P.MAX_STOP_STRINGS + 1)])
    with pytest.raises(KvstateError, match="characters"):
        SamplingParams(stop=["x" * (P.MAX_STOP_CHARS + 1)])


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_values_that_underflow_float32_are_refused(field):
    for value in (1e-46, 1e-40, 1e-300):
        assert np.float32(value) == 0 or np.float32(value) < np.finfo(np.float32).tiny
        with pytest.raises(KvstateError, match=field):
            SamplingParams(**{field: value})
    tiny = float(np.finfo(np.float32).tiny)
    assert np.float32(getattr(SamplingParams(**{field: tiny}), field)) > 0  # the least accepted survives float32
    if field == "repetition_penalty":
        with pytest.raises(KvstateError, match=field):
            SamplingParams(repetition_penalty=1e39)  # inf in float32


def test_message_ends_of_the_last_messages_are_the_full_ones_and_cost_a_bounded_number_of_renders(tmp_path):
    from kvstate.models.tokenizer import Tokenizer
    from tests.models.test_tokenizer import write_tokenizer

    write_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    if not tok.chat_template:
        pytest.skip("the test tokenizer has no chat template")
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} hi"} for i in range(12)]
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    full = tok.message_ends(messages, ids)
    assert tok.message_ends(messages, ids, last=4) == full[-4:]
    renders = []
    real = tok.apply_chat_template
    tok.apply_chat_template = lambda *a, **k: renders.append(1) or real(*a, **k)
    long = [{"role": "user", "content": "hi"}] * 400
    tok.message_ends(long, tok.encode(real(long), add_special_tokens=False), last=4)
    assert len(renders) <= 6  # the conversation, the last 3 messages' variants, the one without the prompt


# -- the engine loop: unread outputs, shutdown -----------------------------------------------------
@pytest.fixture
def loop():
    core = FakeCore(length=10**6)
    loop = EngineLoop(SimpleNamespace(engine=core, plan=core.plan), model_name="fake", max_backlog=4)
    loop.start()
    yield loop
    loop.stop()


def _until(check, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def test_outputs_nobody_reads_abort_their_requests(loop):
    async def main():
        sub = loop.submit([([1], None), ([2], None)])  # never read, as a stream whose client stopped reading
        assert await asyncio.to_thread(_until, lambda: len(loop.core.aborted) == 2)
        return sub

    sub = asyncio.run(main())
    assert not loop.core.live and sub.sent <= 4 * 2 + 2 + 2  # the backlog, then one final output each
    assert loop.alive


def test_a_shutdown_ends_every_request_at_once(loop):
    loop.max_backlog = 10**6  # outputs pile up while this test waits: not the backlog's abort

    async def main():
        sub = loop.submit([([1], None)])
        await sub.__anext__()
        loop.fail_all("the server is shutting down")
        outs = [out async for _, out in sub]
        return outs[-1]

    last = asyncio.run(asyncio.wait_for(main(), 10))
    assert last.finished and last.output.finish_reason == "abort" and "shutting down" in last.output.error
    assert not loop.core.live


# -- the app: fan-out share, metrics, the key ------------------------------------------------------
def _app(**kwargs):
    from kvstate.server.app import create_app

    core = FakeCore()
    core.scheduler = SimpleNamespace(config=SimpleNamespace(max_num_seqs=8))
    return create_app(EngineLoop(SimpleNamespace(engine=core, plan=core.plan, tokenizer=None)), static_dir=None,
                      **kwargs)


def test_a_request_gets_at_most_half_the_running_places():
    from kvstate.server.limits import ServerLimits

    assert _app().state.limits.max_sequences == 4
    assert _app(limits=ServerLimits(max_sequences=3)).state.limits.max_sequences == 3


def test_cumulative_engine_figures_are_counters():
    from prometheus_client.parser import text_string_to_metric_families

    from kvstate.server.metrics import ServerMetrics

    stats = {"num_running": 1, "kv_blocks_used": 3, "num_steps": 9, "num_step_failures": 0, "prefix_hits": 2,
             "prefix_hits_chat": 1, "prefix_lookups": 4, "prefix_prompt_tokens": 50, "prefix_cached_tokens": 20,
             "prefix_hit_rate": 0.4, "snapshots_taken": 3, "snapshots_evicted": 1, "snapshots_held": 2,
             "spec_num_drafts": 5, "spec_num_draft_tokens": 9, "spec_num_accepted_tokens": 4,
             "spec_acceptance_rate": 0.44}
    loop = SimpleNamespace(generated_tokens=7, stats=lambda: stats)
    types = {f.name: f.type for f in text_string_to_metric_families(ServerMetrics(loop).text().decode())}
    gauges = {"num_running", "kv_blocks_used", "prefix_hit_rate", "snapshots_held", "spec_acceptance_rate"}
    for key in stats:
        assert types["kvstate_" + key] == ("gauge" if key in gauges else "counter"), key


def test_metrics_need_the_key_or_their_own():
    from fastapi.testclient import TestClient

    with TestClient(_app(api_key="k")) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer k"}).status_code == 200
        assert c.get("/health").status_code == 200
    with TestClient(_app(api_key="k", metrics_key="m")) as c:
        assert c.get("/metrics", headers={"authorization": "Bearer k"}).status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer m"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": "Bearer m"}).status_code == 401
    with TestClient(_app()) as c:
        assert c.get("/metrics").status_code == 200  # no key at all: open, as before


# -- the explorer -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def explorer(tmp_path_factory):
    from tests.browser.server import explorer_client
    from tests.live_server import write_checkpoint

    yield from explorer_client(write_checkpoint(tmp_path_factory.mktemp("hostile2")))


def test_explorer_calls_never_hold_the_threads_v1_needs(explorer):
    from kvstate.server import explorer_pool

    app, release = explorer.app_ref, threading.Event()
    pool = explorer_pool.pool(app)
    held = pool.executor.submit(release.wait, 30)  # the explorer's thread is busy (a long forward)
    results = []

    def compare():
        results.append(explorer.post("/explorer/api/compare", json={"size": 2}).status_code)

    callers = [threading.Thread(target=compare) for _ in range(explorer_pool.MAX_WAITING + 4)]
    try:
        for t in callers:
            t.start()
        assert _until(lambda: results.count(429) == 4)  # past MAX_WAITING queued: told to come back
        start = time.perf_counter()
        chat = explorer.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert chat.status_code == 200 and time.perf_counter() - start < 5
    finally:
        release.set()
        for t in callers:
            t.join(120)
    held.result()
    assert sorted(set(results)) == [200, 429]


def test_compare_takes_names_never_paths(explorer, tmp_path):
    for other in (str(tmp_path), "/etc", "/no/such/dir", "../../kvstate", "Qwen/Qwen3-0.6B"):
        r = explorer.post("/explorer/api/compare", json={"size": 2, "other": other})
        assert r.status_code == 400 and r.json()["error"]["param"] == "other", (other, r.text)
        assert other not in r.json()["error"]["message"]  # the same answer whether the path exists or not


def test_a_bench_run_needs_the_servers_flag(explorer):
    app = explorer.app_ref
    app.state.explorer_bench_run = None
    r = explorer.post("/explorer/api/scale/run", json={})
    assert r.status_code == 403 and "--explorer-bench-run" in r.json()["error"]["message"]
    assert getattr(app.state, "explorer_bench_run", None) is None  # nothing was started


@pytest.mark.parametrize("figure", ["NaN", "Infinity", "-Infinity", "1e-400", "1e400", "0", "-3", "true"])
def test_uploaded_bench_figures_must_be_finite_and_plausible(explorer, figure):
    from tests.server.test_explorer_lessons_api import BENCH

    before = explorer.get("/explorer/api/scale").text
    body = json.dumps({"bench": BENCH}).replace('"tokens_per_s": 2048.0', f'"tokens_per_s": {figure}')
    assert figure in body
    r = explorer.post("/explorer/api/scale", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    after = explorer.get("/explorer/api/scale")
    assert after.text == before  # nothing stored
    json.loads(after.text, parse_constant=lambda c: pytest.fail(f"{c} in the reply"))  # strict JSON


@pytest.mark.parametrize("machine", ["x", 3, [1], {"threads": "many"}, {"threads": math.inf}])
def test_a_wrong_machine_is_a_400(explorer, machine):
    from tests.server.test_explorer_lessons_api import BENCH

    r = explorer.post("/explorer/api/scale", content=json.dumps({"bench": {**BENCH, "machine": machine}}),
                      headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
