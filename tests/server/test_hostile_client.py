"""A hostile client against a real `kvstate serve` process: the shipped hybrid with prefix caching
and an API key (from KVSTATE_API_KEY), on loopback. Every request of issue #27's table and the
malformed ones of test_bad_requests get a 4xx with OpenAI's error JSON naming the right `param`;
a /health poller runs beside the whole suite (each answer within 1 s: nothing blocks the event
loop); one request's fan-out does not starve a later one; aborted streams' tokens are counted;
an idle server shows its snapshots as held, not used; schemathesis with the key finds no 5xx; the
server's RSS grows by less than 300 MB. The module's last test prints the suite's figures."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")

from kvstate.shipped import DEFAULT_MODEL  # noqa: E402
from tests.live_server import start_serve  # noqa: E402
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME  # noqa: E402
from tests.server.test_bad_requests import BAD  # noqa: E402

KEY = "hostile-test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
C, CHAT, MEMORY, SCALE = "/v1/completions", "/v1/chat/completions", "/explorer/api/memory", "/explorer/api/scale"
SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "kvstate", "data", "models", DEFAULT_MODEL)
CONFIG = json.load(open(os.path.join(SHIPPED, "config.json")))
NO_TYPES = {k: v for k, v in CONFIG.items() if k != "layer_types"}
HUGE = json.dumps({"prompt": "Hello " * 8_700_000}).encode()  # 52 MB
HUGE_CHAT = json.dumps({"messages": [{"role": "user", "content": "Hello " * 8_700_000}]}).encode()
LONG = "Hello " * 200_000  # 1.2 MB: under the body limit, over 32 characters per token of 256
FIGURES: dict = {"requests": 0, "5xx": 0, "timings": {}}
# One server and one FIGURES table for the whole module: its tests share an xdist worker
# (`make test` runs with --dist loadgroup), so the last test sees every request the others sent.
pytestmark = pytest.mark.xdist_group("hostile_client")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


POLLER = """
import sys, time, httpx

url, out = sys.argv[1], open(sys.argv[2], "a")
with httpx.Client(timeout=10) as client:
    while True:
        start = time.perf_counter()
        try:
            ok = client.get(url + "/health").status_code == 200
        except httpx.HTTPError:
            ok = False
        print(time.time(), time.perf_counter() - start if ok else 10.0, file=out, flush=True)
        time.sleep(0.05)
"""

# Another client beside every case: a 16-token completion every 0.2 s (issue #41: none above 1 s)
PROBE = """
import sys, time, httpx

url, out, key = sys.argv[1], open(sys.argv[2], "a"), sys.argv[3]
body = {"prompt": "The phone book", "max_tokens": 16, "ignore_eos": True}
with httpx.Client(timeout=60, headers={"authorization": "Bearer " + key}) as client:
    while True:
        start = time.perf_counter()
        try:
            ok = client.post(url + "/v1/completions", json=body).status_code == 200
        except httpx.HTTPError:
            ok = False
        print(time.time(), time.perf_counter() - start if ok else 60.0, file=out, flush=True)
        time.sleep(0.2)
"""


class HealthWatch:
    """GET /health every 50 ms for the whole suite, from a process of its own (so that the test
    process's own work never delays a poll); a failed poll counts as 10 s. With `script=PROBE`:
    another client's 16-token completion every 0.2 s instead (a failed one counts as 60 s)."""

    def __init__(self, url: str, log, script: str = POLLER):
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-c", script, url, str(log), KEY])
        self.spans: list[tuple[str, float, float]] = []  # (test, start, end) wall clock

    def polls(self) -> list[tuple[float, float]]:
        if not self.log.exists():  # its process has not polled yet
            return []
        return [tuple(map(float, line.split())) for line in self.log.read_text().splitlines() if line.strip()]

    def slowest_by_test(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for when, took in self.polls():  # the test whose span overlaps the poll most
            overlap = {n: min(when, b) - max(when - took, a) for n, a, b in self.spans}
            name = max(overlap, key=overlap.get, default=None)
            name = name if name is not None and overlap[name] > 0 else "between tests"
            out[name] = max(out.get(name, 0.0), took)
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _count(response):
    FIGURES["requests"] += 1
    FIGURES["5xx"] += response.status_code >= 500


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = start_serve("--max-model-len", str(MAX_MODEL_LEN), "--cache-memory", "32MiB", "--served-model-name",
                            MODEL_NAME, "--enable-prefix-caching", env={"KVSTATE_API_KEY": KEY})
    try:
        with httpx.Client(base_url=url, headers=AUTH, timeout=60, event_hooks={"response": [_count]}) as client:
            client.post(C, json={"prompt": "warm up", "max_tokens": 2})  # first-request costs out of the RSS figure
            FIGURES["rss_before"] = _rss_mb(proc.pid)
            watch = HealthWatch(url, tmp_path_factory.mktemp("health") / "polls.txt")
            probe = HealthWatch(url, tmp_path_factory.mktemp("probe") / "probes.txt", PROBE)
            watch.spans = probe.spans  # one list of test spans for both
            FIGURES["probe"] = probe
            try:
                yield url, client, proc, watch
            finally:
                watch.stop()
                probe.stop()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.fixture(autouse=True)
def _span(request):
    """Each test's wall-clock span, to tell which one a slow /health answer fell in."""
    start = time.time()
    yield
    watch = request.getfixturevalue("server")[3] if "server" in request.fixturenames else None
    if watch is not None:
        watch.spans.append((request.node.name, start, time.time()))


def _metrics(url: str) -> dict:
    values = {}
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def _wait_idle(url: str) -> dict:
    for _ in range(600):
        m = _metrics(url)
        if not (m["kvstate_num_running"] or m["kvstate_num_waiting"] or m["kvstate_num_pending"]):
            return m
        time.sleep(0.05)
    return m


def _assert_error(resp, status: int, param):
    assert resp.status_code == status, resp.text[:300]
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["type"] and error["param"] == param, error


def test_the_key_is_needed_but_health_and_the_page_stay_open(server):
    url, *_ = server
    for method, path in (("GET", "/v1/models"), ("POST", C), ("POST", CHAT), ("GET", "/explorer/api/models"),
                         ("POST", MEMORY), ("GET", "/metrics"), ("POST", "/tokenize"),
                         ("POST", "/detokenize"), ("GET", "/tokenizer_info")):
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            with httpx.Client(event_hooks={"response": [_count]}) as bare:
                resp = bare.request(method, url + path, json={}, headers=headers)
            assert resp.status_code == 401, (method, path, headers)
            assert resp.json()["error"]["code"] == "invalid_api_key"
    with httpx.Client(event_hooks={"response": [_count]}) as bare:
        for path in ("/health", "/"):
            assert bare.get(url + path).status_code == 200, path


TABLE = [  # (name, method, path, json body or raw bytes, status, param)
    ("10**12 layers", "POST", MEMORY, {"config": {**NO_TYPES, "num_hidden_layers": 10**12,
                                                   "full_attention_interval": 4}}, 400, "config.num_hidden_layers"),
    ("10**5 layers", "POST", MEMORY, {"config": {**NO_TYPES, "num_hidden_layers": 10**5,
                                                  "full_attention_interval": 4}}, 400, "config.num_hidden_layers"),
    ("head_dim 10**30", "POST", MEMORY, {"config": {**CONFIG, "head_dim": 10**30}}, 400, "config.head_dim"),
    ("vocab 10**12", "POST", MEMORY, {"config": {**CONFIG, "vocab_size": 10**12}}, 400, "config.vocab_size"),
    ("context 10**9", "POST", MEMORY, {"config": CONFIG, "context": 10**9}, 400, "context"),
    ("50 MB prompt", "POST", C, HUGE, 413, None),
    ("50 MB chat", "POST", CHAT, HUGE_CHAT, 413, None),
    ("1.2 MB prompt", "POST", C, {"prompt": LONG}, 400, "prompt"),
    ("1.2 MB chat", "POST", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("7 MB, unknown model", "POST", C, {"model": "gpt-9", "prompt": "Hello " * 1_200_000}, 404, "model"),
    ("lone surrogate", "POST", C, b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate, list", "POST", C, b'{"prompt": ["ok", "a\\ud800b"]}', 400, "prompt"),
    ("lone surrogate, chat", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "messages"),
    ("lone surrogate, stop", "POST", C, b'{"prompt": "hi", "stop": "\\udfff"}', 400, "stop"),
    ("lone surrogate, model", "POST", C, b'{"prompt": "hi", "model": "\\ud800"}', 404, "model"),
    ("lone surrogate, cache run", "POST", "/explorer/api/cache", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate, cache time", "POST", "/explorer/api/cache/time", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate, gates", "POST", "/explorer/api/gates", b'{"prompt": "a\\ud800b"}', 400, "prompt"),
    ("lone surrogate, compare", "POST", "/explorer/api/compare", b'{"other": "\\ud800"}', 400, "other"),
    ("1000 prompts x n=16", "POST", C, {"prompt": ["Hi"] * 1000, "n": 16, "max_tokens": 64, "ignore_eos": True},
     400, "prompt"),
    ("8 prompts x n=16", "POST", C, {"prompt": ["Hi"] * 8, "n": 16, "max_tokens": 4}, 400, "n"),
    ("stop_token_ids 10**9", "POST", C, {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("tools", "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                             "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("tool_choice", "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, 400,
     "tool_choice"),
    ("json_object", "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}],
                                   "response_format": {"type": "json_object"}}, 400, "response_format"),
    ("no content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages"),
    ("assistant tool call", "POST", CHAT, {"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, 400,
     "messages"),
    ("GET completions", "GET", C, None, 405, None),
    ("GET chat", "GET", CHAT, None, 405, None),
    ("DELETE completions", "DELETE", C, None, 405, None),
    ("PUT explorer memory", "PUT", MEMORY, None, 405, None),
    # issue #41
    ("3M stop_token_ids", "POST", C, {"prompt": ["Hi"] * 16, "stop_token_ids": [0] * 3_000_000}, 400,
     "stop_token_ids"),
    ("32 prompts x 200 tokens", "POST", C, {"prompt": ["Hi"] * 32, "max_tokens": 200, "ignore_eos": True}, 400,
     "prompt"),  # more than half of --max-num-seqs (32)
    ("1500 chat turns", "POST", CHAT, {"messages": [{"role": "user", "content": "hi"}] * 1500}, 400, "messages"),
    ("270k empty messages", "POST", CHAT, {"messages": [{"role": "user", "content": ""}] * 270_000}, 400,
     None),  # more JSON objects than a body may hold (kvstate.server.body), refused before parsing
    ("top_p 1e-46", "POST", C, {"prompt": "hi", "top_p": 1e-46}, 400, "top_p"),
    ("repetition_penalty 1e-46", "POST", C, {"prompt": "hi", "repetition_penalty": 1e-46}, 400,
     "repetition_penalty"),
    ("bench figure NaN", "POST", SCALE, b'{"bench": {"rows": [{"impl": "kvstate", "phase": "prefill", '
     b'"tokens_per_s": NaN, "ms_per_step": 1}, {"impl": "kvstate", "phase": "decode", "batch": 1, '
     b'"tokens_per_s": 10, "ms_per_step": 1}]}}', 400, None),
    ("bench figure Infinity", "POST", SCALE, b'{"bench": {"rows": [{"impl": "kvstate", "phase": "prefill", '
     b'"tokens_per_s": 10, "ms_per_step": 1}, {"impl": "kvstate", "phase": "decode", "batch": 1, '
     b'"tokens_per_s": 10, "ms_per_step": Infinity}]}}', 400, None),
    ("bench machine 3", "POST", SCALE, {"bench": {"machine": 3, "rows": [
        {"impl": "kvstate", "phase": "prefill", "tokens_per_s": 10, "ms_per_step": 1},
        {"impl": "kvstate", "phase": "decode", "batch": 1, "tokens_per_s": 10, "ms_per_step": 1}]}}, 400, None),
    ("bench run without the flag", "POST", SCALE + "/run", {}, 403, None),
    ("compare a server path", "POST", "/explorer/api/compare", {"other": "/etc"}, 400, "other"),
    # validation that held the event loop (kvstate.server.body): one error object per bad item, a union
    # over every prompt form, nested objects parsed and validated on the loop
    ("1.5M bad token ids", "POST", C, {"prompt": [1] + ["a"] * 1_500_000}, 400, "prompt"),
    ("400k prompts of ids", "POST", C, {"prompt": [[1, 2]] * 400_000}, 400, None),
    ("5000 content parts", "POST", CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]
                                                        * 5000}]}, 400, "messages"),
    ("200k metadata entries", "POST", C, {"prompt": "hi", "metadata": {str(i): [1, [2, {"a": 3}]]
                                                                       for i in range(200_000)}}, 400, None),
]


@pytest.mark.parametrize("name, method, path, body, status, param", TABLE, ids=[row[0] for row in TABLE])
def test_each_hostile_request_is_a_clear_4xx(server, name, method, path, body, status, param):
    url, client, *_ = server
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else (
        {} if body is None else {"json": body})
    start = time.perf_counter()
    resp = client.request(method, path, **kwargs)
    FIGURES["timings"][name] = time.perf_counter() - start
    _assert_error(resp, status, param)


def test_six_large_bodies_at_once_leave_health_answering(server):
    """Six 5.9 MB prompts of token ids at once: validated on the event loop they held /health 1.5 s."""
    url, client, *_ = server
    body = json.dumps({"prompt": list(range(200)) * 6000}).encode()
    codes = []

    def send():
        codes.append(client.post(C, content=body, headers={"content-type": "application/json"}).status_code)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert codes == [400] * 6  # longer than the model


def test_a_burst_of_1000_connections_opened_and_closed(server):
    url, client, proc, _ = server
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(1000):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, int(port)))
        socks.append(s)
    time.sleep(1.0)
    for s in socks:
        s.close()
    time.sleep(0.5)
    assert proc.poll() is None and client.get("/health").status_code == 200


def test_a_body_without_length_is_cut_off_past_the_limit(server):
    url, client, *_ = server

    def chunks():
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"Hello " * 20_000  # 12 MB in all, no Content-Length (chunked)
        yield b'"}'

    resp = client.post(C, content=chunks(), headers={"content-type": "application/json"})
    _assert_error(resp, 413, None)


def test_a_client_that_waits_for_100_continue_gets_the_413_without_sending(server):
    url, *_ = server
    host, port = url.removeprefix("http://").split(":")
    start = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {C} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(HUGE)}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        head = sock.recv(65536).decode()
    FIGURES["timings"]["50 MB, Expect: 100-continue"] = time.perf_counter() - start
    FIGURES["requests"] += 1
    assert head.startswith("HTTP/1.1 413"), head[:200]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_the_malformed_requests_stay_4xx_with_the_key(server, i):
    url, client, *_ = server
    path, body, status, param = BAD[i]
    if isinstance(body, bytes):
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post(path, json=body)
    _assert_error(resp, status, param)


def test_one_requests_fanout_does_not_starve_a_later_one(server):
    url, client, *_ = server
    done = {}

    def big():
        client.post(C, json={"prompt": ["Hi"] * 4, "n": 4, "max_tokens": 80, "ignore_eos": True})
        done["big"] = time.perf_counter()

    thread = threading.Thread(target=big)
    thread.start()
    while _metrics(url)["kvstate_num_running"] < 2:
        time.sleep(0.01)
    resp = client.post(C, json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
    done["small"] = time.perf_counter()
    thread.join(120)
    assert resp.status_code == 200 and "big" in done
    assert done["small"] < done["big"]  # admitted in turn, not after the 16 sequences ahead of it


def test_tokens_of_streams_left_early_are_counted(server):
    url, client, *_ = server
    before = _wait_idle(url)["kvstate_generation_tokens_total"]
    for _ in range(3):
        with client.stream("POST", C, json={"prompt": "hello", "max_tokens": 100, "ignore_eos": True,
                                            "stream": True}) as resp:
            assert resp.status_code == 200
            for i, _line in enumerate(resp.iter_lines()):
                if i >= 6:  # three chunks (each followed by a blank line), then leave
                    break
    after = _wait_idle(url)["kvstate_generation_tokens_total"]
    assert after - before >= 9


def test_an_idle_server_shows_snapshots_as_held_not_used(server):
    url, client, *_ = server
    for _ in range(2):
        client.post(C, json={"prompt": list(range(3, 60)), "max_tokens": 2})
    m = _wait_idle(url)
    assert m["kvstate_state_slots_used"] == 0 and m["kvstate_kv_blocks_used"] == 0
    assert m["kvstate_state_slots_held"] >= 1 and m["kvstate_snapshots_held"] == m["kvstate_state_slots_held"]


def test_schemathesis_with_the_key_finds_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis.generation import GenerationMode

    url, client, *_ = server
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    for op in (op.ok() for op in schema.get_all_operations()):
        @given(case=st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE)))
        @settings(max_examples=8, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def check(case):
            if isinstance(case.body, dict):
                for key in ("max_tokens", "max_completion_tokens"):
                    if case.body.get(key) is None or (isinstance(case.body[key], int) and case.body[key] > 2):
                        case.body[key] = 2
                if isinstance(case.body.get("n"), int) and case.body["n"] > 2:
                    case.body["n"] = 2
            resp = case.call(base_url=url, headers=AUTH, timeout=30)
            FIGURES["requests"] += 1
            FIGURES["5xx"] += resp.status_code >= 500
            assert resp.status_code < 500, (case.method, case.path, case.body, resp.text)
            if op.path.startswith("/v1/"):  # the same request without the key: 401
                bare = case.call(base_url=url, headers={"authorization": ""}, timeout=30)
                FIGURES["requests"] += 1
                assert bare.status_code == 401, (case.method, case.path, bare.text)

        check()


def _at_least(watch: HealthWatch, n: int, timeout: float = 20.0) -> None:
    """Wait until `watch` has logged n polls: on a loaded machine, or a worker that drew few of the
    cases, its process may have started late; its polls must still cover a running server."""
    end = time.monotonic() + timeout
    while len(watch.polls()) < n and time.monotonic() < end:
        time.sleep(0.1)


def test_zz_the_server_held_up(server):
    url, client, proc, watch = server
    _wait_idle(url)
    _at_least(watch, 11)
    _at_least(FIGURES["probe"], 11)
    rss_after = _rss_mb(proc.pid)
    def ms(name: str) -> str:  # a figure of a test that ran on this worker, or "-" (a -k or split run)
        sec = FIGURES["timings"].get(name)
        return "-" if sec is None else f"{sec * 1e3:.0f}"

    polls = watch.polls()
    worst = max(took for _, took in polls)
    print(f"\nhostile-client suite: {FIGURES['requests']} requests, {FIGURES['5xx']} 5xx; worst /health "
          f"{worst * 1e3:.0f} ms over {len(polls)} polls; RSS {FIGURES['rss_before']:.0f} -> {rss_after:.0f} MB; "
          f"50 MB body {ms('50 MB prompt')} ms (sent whole; {ms('50 MB, Expect: 100-continue')} ms "
          f"with Expect: 100-continue); 10**12-layer config {ms('10**12 layers')} ms")
    slowest = sorted(watch.slowest_by_test().items(), key=lambda kv: -kv[1])[:3]
    print("slowest /health by test: " + ", ".join(f"{name} {sec * 1e3:.0f} ms" for name, sec in slowest))
    probe = FIGURES["probe"]
    probes = probe.polls()
    worst_probe = max(took for _, took in probes)
    slowest = sorted(probe.slowest_by_test().items(), key=lambda kv: -kv[1])[:3]
    print(f"another client's 16-token completion: {len(probes)} sent, worst {worst_probe * 1e3:.0f} ms; slowest by "
          "test: " + ", ".join(f"{name} {sec * 1e3:.0f} ms" for name, sec in slowest))
    assert proc.poll() is None and FIGURES["5xx"] == 0
    assert len(polls) > 10 and worst < 1.0  # the event loop never held /health for a second
    assert len(probes) > 10 and worst_probe < 1.0  # no case held another client's request for a second
    assert rss_after - FIGURES["rss_before"] < 300
