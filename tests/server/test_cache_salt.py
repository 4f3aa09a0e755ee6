"""`cache_salt` and cache reports over HTTP: the body's `cache_salt` isolates tenants (different
salts share 0 tokens, the same salt's repeat reuses all but the last), every reply carries the
`kvstate_cache` object beside `usage` (whole and streamed), an OpenAI client reads the reply as
usual, /metrics counts misses by reason, and the explorer's engine view lists the last reports."""

import re

import pytest

httpx = pytest.importorskip("httpx")

from kvstate import LLM  # noqa: E402
from tests.live_server import ServerThread  # noqa: E402

KW = dict(cache_memory="16MiB", max_model_len=256, max_num_seqs=4, block_size=4, enable_prefix_caching=True)
BODY = dict(max_tokens=3, temperature=0, ignore_eos=True)
PROMPT = list(range(3, 43))


def test_salts_over_http_and_the_cache_extension(checkpoint):
    from kvstate.server import explorer
    from kvstate.server.app import create_app

    app = create_app(LLM(checkpoint, **KW), model_name="tiny", routers=[explorer.router])
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        def send(salt=None, **extra):
            body = {"prompt": PROMPT, **BODY, **extra, **({"cache_salt": salt} if salt else {})}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        first, other, again = send("a"), send("b"), send("a")
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, other, again)]
        assert cached == [0, 0, len(PROMPT) - 1]
        assert [r["choices"][0]["text"] for r in (other, again)] == [first["choices"][0]["text"]] * 2
        reports = [r["kvstate_cache"]["prompts"][0] for r in (first, other, again)]
        assert [r["reason"] for r in reports] == ["no_match", "salt_mismatch", None]
        assert reports[2]["source"] == "repeat" and reports[2]["reused_tokens"] == len(PROMPT) - 1
        with client.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi there"}], "cache_salt": "c", "stream": True,
                "stream_options": {"include_usage": True}, **BODY}) as r:
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
        last = httpx.Response(200, content=chunks[-1]).json()
        assert "usage" in last and last["kvstate_cache"]["prompts"][0]["salted"] is True
        bad = client.post("/v1/completions", json={"prompt": PROMPT, "cache_salt": "", **BODY})
        assert bad.status_code == 400
        metrics = client.get("/metrics").text
        view = client.get("/explorer/api/engine", params={"since": -1}).json()["view"]
        try:
            import openai
        except ImportError:
            openai = None
        if openai is not None:  # the extension is ignored by OpenAI's own client
            oa = openai.OpenAI(base_url=f"{url}/v1", api_key="x")
            done = oa.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0,
                                         extra_body={"cache_salt": "a", "ignore_eos": True})
            assert done.usage.prompt_tokens_details.cached_tokens == len(PROMPT) - 1
    misses = {k: float(v) for k, v in re.findall(r"^kvstate_prefix_misses_(\w+) (\S+)$", metrics, re.M)}
    assert misses["salt_mismatch"] == 1 and misses["no_match"] >= 2, misses
    assert [r["reason"] for r in view["cache_reports"][-3:]] == [None, "salt_mismatch", "no_match"]
