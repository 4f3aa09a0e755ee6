"""Continuous batching across HTTP clients: 32 concurrent streams on loopback all finish with every
token (and the greedy ones with the tokens `LLM.generate` gives), in fewer steps than one at a time
would take; afterwards the pools are empty. A client that leaves mid-stream is aborted: its
sequence is freed long before its max_tokens could have run out."""

import asyncio
import json

import httpx

from kvstate import SamplingParams
from tests.server.conftest import MODEL_NAME, wait_idle

N_CLIENTS, MAX_TOKENS = 32, 8
PROMPTS = ["the quick brown", "hybrid models", "state slots", "paged attention"]


async def _stream(client, prompt, **extra):
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}, **extra}
    text, usage, reason = "", None, None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text += chunk["choices"][0]["text"]
                reason = chunk["choices"][0]["finish_reason"] or reason
            usage = chunk.get("usage") or usage
    return text, usage, reason


def test_32_concurrent_streams_finish_and_free_the_pools(live_server, reference_llm):
    loop = live_server.loop
    steps_before = wait_idle(loop)["num_steps"]

    async def main():
        async with httpx.AsyncClient(base_url=live_server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=N_CLIENTS)) as client:
            return await asyncio.gather(*(_stream(client, PROMPTS[i % 4]) for i in range(N_CLIENTS)))

    results = asyncio.run(asyncio.wait_for(main(), 120))
    want = {p: reference_llm.generate(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))[0].text
            for p in PROMPTS}
    for i, (text, usage, reason) in enumerate(results):
        assert usage["completion_tokens"] == MAX_TOKENS and reason == "length"
        assert text == want[PROMPTS[i % 4]]
    stats = wait_idle(loop)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    # batched: one request at a time would need N_CLIENTS * MAX_TOKENS steps
    assert stats["num_steps"] - steps_before < N_CLIENTS * MAX_TOKENS // 2


def test_a_client_that_leaves_mid_stream_is_aborted(live_server):
    loop = live_server.loop
    steps_before = wait_idle(loop)["num_steps"]
    max_tokens = 200
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=live_server.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            for _ in range(3):  # a few tokens in, the client goes away
                assert next(l for l in lines if l.startswith("data: "))
            assert loop.stats()["state_slots_used"] == 1
    stats = wait_idle(loop)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["num_steps"] - steps_before < max_tokens // 2  # stopped, not run to max_tokens
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_a_client_that_leaves_before_its_whole_reply_is_aborted(live_server):
    """Not streamed: the handler sees the connection close while it waits and aborts its request."""
    import socket
    import time

    loop = live_server.loop
    steps_before = wait_idle(loop)["num_steps"]
    max_tokens = 240
    body = json.dumps({"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(2000):  # until the request holds its state slot, then hang up
            if loop.stats()["state_slots_used"]:
                break
            time.sleep(0.005)
    stats = wait_idle(loop)
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0
    assert stats["num_steps"] - steps_before < max_tokens // 2  # stopped, not run to max_tokens
