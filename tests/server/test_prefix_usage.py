"""A server with prefix caching reports reuse as OpenAI does: `usage.prompt_tokens_details.cached_tokens`
(completions and chat, whole and streamed with include_usage) equals what `LLM` reports as
`num_cached_tokens` for the same requests in the same order; a chat's message ends and a body's
`cache_prefix` are kept; /metrics counts hits by kind."""

import re

import pytest

httpx = pytest.importorskip("httpx")

from kvstate import LLM, SamplingParams  # noqa: E402
from tests.live_server import ServerThread  # noqa: E402

KW = dict(cache_memory="16MiB", max_model_len=256, max_num_seqs=4, block_size=4, enable_prefix_caching=True)
DOC = "the quick brown fox jumps over the lazy dog. " * 3 + "END"


def chats():
    return [[{"role": "system", "content": DOC}, {"role": "user", "content": q}]
            for q in ("who jumps", "who jumps", "what is lazy", "the fox")]


def test_cached_tokens_equal_llm_num_cached_tokens(checkpoint):
    from kvstate.server.app import create_app

    ref = LLM(checkpoint, **KW)
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = [ref.chat(m, greedy)[0].num_cached_tokens for m in chats()]
    prompt = DOC + " and then"
    ids = ref.tokenizer.encode(prompt)
    want += [ref.generate([{"prompt": prompt, "cache_prefix": DOC}], greedy)[0].num_cached_tokens,
             ref.generate([DOC + " or not"], greedy)[0].num_cached_tokens]
    assert want[1] == len(ref.tokenizer.encode(ref.tokenizer.apply_chat_template(chats()[0]),
                                               add_special_tokens=False)) - 1  # the repeat hits
    assert 0 < want[2] < want[1] and want[5] == len(ref.tokenizer.encode(DOC)) and len(ids) > want[5]

    app = create_app(LLM(checkpoint, **KW), model_name="tiny")
    body = dict(max_tokens=3, temperature=0, ignore_eos=True)
    got = []
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        for k, messages in enumerate(chats()):
            if k % 2:  # streamed: the usage chunk carries it
                with client.stream("POST", "/v1/chat/completions", json={
                        "messages": messages, "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
                    chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
                usage = httpx.Response(200, content=chunks[-1]).json()["usage"]
            else:
                usage = client.post("/v1/chat/completions", json={"messages": messages, **body}).json()["usage"]
            got.append(usage["prompt_tokens_details"]["cached_tokens"])
        for extra in ({"prompt": prompt, "cache_prefix": DOC}, {"prompt": DOC + " or not"}):
            got.append(client.post("/v1/completions", json={**extra, **body}).json()["usage"]
                       ["prompt_tokens_details"]["cached_tokens"])
        bad = client.post("/v1/completions", json={"prompt": prompt, "cache_prefix": "not the start", **body})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_prefix"
        metrics = client.get("/metrics").text
    assert got == want
    hits = {k: float(v) for k, v in re.findall(r"^kvstate_prefix_hits_(\w+)_total (\S+)$", metrics, re.M)}
    assert hits["repeat"] == 1 and hits["chat"] >= 1 and hits["prefix"] == 1, hits
