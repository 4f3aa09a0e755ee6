"""Bad requests get OpenAI's error JSON with a 4xx code, never a 5xx, and the server keeps serving:
malformed JSON, wrong types, out-of-range parameters, prompts too long for the model, tokens outside
the vocabulary, an unknown model, unsupported fields; then schemathesis on the OpenAPI schema."""

import pytest

httpx = pytest.importorskip("httpx")

from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME, wait_idle  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK_C = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

BAD = [  # (path, body or raw bytes, expected status, the param named or None)
    (C, b"{not json", 400, None),
    (C, b"", 400, None),
    (C, b"[1, 2]", 400, None),
    (C, b"null", 400, None),
    (C, {"model": MODEL_NAME}, 400, "prompt"),
    (C, {**OK_C, "prompt": 12}, 400, "prompt"),
    (C, {**OK_C, "prompt": []}, 400, "prompt"),
    (C, {**OK_C, "prompt": [[]]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [1, "a"]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [10**6]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [-1]}, 400, "prompt"),
    (C, {**OK_C, "prompt": [7] * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
    (C, {**OK_C, "prompt": [7] * (MAX_MODEL_LEN - 10), "max_tokens": 50}, 400, "prompt"),
    (C, {**OK_C, "model": "gpt-9"}, 404, "model"),
    (C, {**OK_C, "temperature": -1}, 400, "temperature"),
    (C, {**OK_C, "temperature": "hot"}, 400, "temperature"),
    (C, {**OK_C, "top_p": 0}, 400, "top_p"),
    (C, {**OK_C, "top_p": 1.5}, 400, "top_p"),
    (C, {**OK_C, "max_tokens": 0}, 400, "max_tokens"),
    (C, {**OK_C, "max_tokens": 10**12}, 400, "prompt"),
    (C, {**OK_C, "n": 0}, 400, "n"),
    (C, {**OK_C, "n": 10**6}, 400, "n"),
    (C, {**OK_C, "logprobs": 10**6}, 400, "logprobs"),
    (C, {**OK_C, "presence_penalty": 3}, 400, "presence_penalty"),
    (C, {**OK_C, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (C, {**OK_C, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {**OK_C, "seed": 2**70}, 400, "seed"),
    (C, {**OK_C, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    (C, {**OK_C, "stop": 5}, 400, "stop"),
    (C, {**OK_C, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    (C, {**OK_C, "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    (C, {**OK_C, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    (C, {**OK_C, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    (C, {**OK_C, "best_temperature": 1}, 400, "best_temperature"),
    (CHAT, {**OK_CHAT, "echo": True}, 400, "echo"),
    (CHAT, {**OK_CHAT, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    (C, {**OK_C, "stream": "yes please"}, 400, "stream"),
    (CHAT, {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL_NAME, "messages": "hi"}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi " * 400}]}, 400, "prompt"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT, {**OK_CHAT, "model": "gpt-9"}, 404, "model"),
]


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("path, body, status, param", BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_request_is_a_4xx_error_json(client, path, body, status, param):
    if isinstance(body, bytes):
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post(path, json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "Traceback" not in error["message"]
    assert error["type"] and error["param"] == param


def test_wrong_method_path_and_content_type(client):
    assert client.get(C).status_code in (404, 405)  # 404 where the static explorer at / answers GETs
    assert client.post("/v1/nope", json={}).status_code == 404
    assert client.post("/nope", json={}).status_code == 404
    assert client.post("/health", json={}).status_code == 405  # a route that takes GET only
    resp = client.post(C, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert resp.status_code == 400 and resp.json()["error"]["message"]


def test_still_serving_after_bad_requests(client, live_server):
    for path, body, *_ in BAD[:10]:
        client.post(path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post(C, json=OK_C).json()["usage"]["completion_tokens"] >= 1
    stats = wait_idle(live_server.loop)
    assert stats["kv_blocks_used"] == 0 and stats["num_step_failures"] == 0


def test_metrics_count_requests_tokens_and_pools(client, live_server):
    client.post(C, json={**OK_C, "max_tokens": 3, "ignore_eos": True})
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['kvstate_http_requests_total{code="200",route="/v1/completions"}'] >= 1
    assert values["kvstate_generation_tokens_total"] >= 3 and values["kvstate_prompt_tokens_total"] >= 1
    stats = live_server.loop.stats()
    assert values["kvstate_kv_blocks_total"] == stats["kv_blocks_total"] > 0
    assert values["kvstate_state_slots_total"] == stats["state_slots_total"] > 0
    for gauge in ("kvstate_num_running", "kvstate_num_waiting", "kvstate_num_pending", "kvstate_kv_blocks_used",
                  "kvstate_state_slots_used"):
        assert gauge in values
