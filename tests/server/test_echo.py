"""Completions `echo` (the legacy logprobs object over prompt + output, as lm-evaluation-harness reads
it), vLLM's `prompt_logprobs` field, and the tokenizer endpoints (/tokenize, /detokenize,
/tokenizer_info) in vLLM's shapes, against `LLM`'s prompt_logprobs and the tokenizer itself."""

import pytest

httpx = pytest.importorskip("httpx")

from kvstate import SamplingParams  # noqa: E402
from tests.server.conftest import MAX_MODEL_LEN, MODEL_NAME  # noqa: E402

C = "/v1/completions"
TEXT = "the quick brown fox"


@pytest.fixture(scope="module")
def client(live_server):
    with httpx.Client(base_url=live_server.url, timeout=60) as c:
        yield c


def scored(llm, ids, k=1):
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=k))[0].prompt_logprobs


def test_echo_token_ids_as_lm_eval_sends_them(client, reference_llm):
    """lm-eval's loglikelihood request: [[ids]], echo, logprobs 1, max_tokens 1, batched."""
    tok = reference_llm.tokenizer
    prompts = [tok.encode(TEXT, add_special_tokens=False), tok.encode("a b c d e", add_special_tokens=False)]
    body = {"model": MODEL_NAME, "prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0, "seed": 1234}
    resp = client.post(C, json=body)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    for ids, choice in zip(prompts, choices):
        want = scored(reference_llm, ids)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(1, len(ids)):
            assert abs(lp["token_logprobs"][p] - want[p][ids[p]].logprob) < 1e-5
            top = max(want[p].values(), key=lambda e: e.logprob)
            assert abs(max(lp["top_logprobs"][p].values()) - top.logprob) < 1e-5
        gen = reference_llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=1))[0]
        assert choice["text"] == tok.decode(ids, skip_special_tokens=False) + gen.text
        assert abs(lp["token_logprobs"][-1] - gen.logprobs[0][0]) < 1e-5
        pieces = lp["tokens"]
        assert lp["text_offset"] == [sum(len(t) for t in pieces[:i]) for i in range(len(pieces))]


def test_echo_text_prompt_with_max_tokens_zero(client, reference_llm):
    resp = client.post(C, json={"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 0})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = reference_llm.tokenizer.encode(TEXT)
    want = scored(reference_llm, ids, 2)
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and resp.json()["usage"]["completion_tokens"] == 0
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - want[p][ids[p]].logprob) < 1e-5
        assert 2 <= len(lp["top_logprobs"][p]) <= 3  # the prompt's token and the 2 most likely


def test_echo_without_logprobs_repeats_the_prompt(client):
    resp = client.post(C, json={"prompt": [TEXT, "a b"], "echo": True, "max_tokens": 2, "temperature": 0})
    choices = resp.json()["choices"]
    assert choices[0]["text"].startswith(TEXT) and choices[1]["text"].startswith("a b")
    assert choices[0]["logprobs"] is None


def test_generated_logprobs_hold_k_alternatives(client, reference_llm):
    resp = client.post(C, json={"prompt": TEXT, "logprobs": 3, "max_tokens": 3, "temperature": 0,
                                "ignore_eos": True})
    lp = resp.json()["choices"][0]["logprobs"]
    want = reference_llm.generate([TEXT], SamplingParams(temperature=0, max_tokens=3, logprobs=3, ignore_eos=True))[0]
    decode = lambda t: reference_llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    for tid, (value, alts), top in zip(want.token_ids, want.logprobs, lp["top_logprobs"]):
        assert len(alts) == 3 and set(top) == {decode(tid), *(decode(t) for t, _ in alts)}  # keyed by text
        assert top[decode(tid)] == value and max(top.values()) == value  # greedy: the chosen one is the most likely


def test_prompt_logprobs_field(client, reference_llm):
    ids = reference_llm.tokenizer.encode(TEXT)
    resp = client.post(C, json={"prompt": ids, "prompt_logprobs": 2, "max_tokens": 1})
    got = resp.json()["choices"][0]["prompt_logprobs"]
    want = scored(reference_llm, ids, 2)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        assert set(got[p]) == {str(t) for t in want[p]}
        own = got[p][str(ids[p])]
        assert own["rank"] == want[p][ids[p]].rank and abs(own["logprob"] - want[p][ids[p]].logprob) < 1e-5
        assert own["decoded_token"] == reference_llm.tokenizer.decode([ids[p]], skip_special_tokens=False)


def test_tokenize_detokenize_and_info(client, reference_llm):
    tok = reference_llm.tokenizer
    got = client.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert got.status_code == 200, got.text
    body = got.json()
    assert body["tokens"] == tok.encode(TEXT, add_special_tokens=False) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == MAX_MODEL_LEN and "".join(body["token_strs"]).strip() == TEXT
    chat = client.post("/tokenize", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    back = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": tok.decode(body["tokens"], skip_special_tokens=False)}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert "bos_token" in info and "pad_token" in info


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-9"}, "model"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_tokenizer_endpoints_refuse_bad_input(client, path, body, param):
    resp = client.post(path, json=body)
    assert 400 <= resp.status_code < 500 and resp.json()["error"]["param"] == param


def test_lm_eval_detects_the_remote_tokenizer(live_server):
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(live_server.url + "/v1/completions")
    remote = utils.RemoteTokenizer(live_server.url + "/v1/completions")
    assert remote.decode(remote.encode(TEXT)) == TEXT


def _streamed(client, body) -> dict:
    """The choices of a streamed completion, each chunk's text and logprobs lists joined."""
    import json

    choices: dict = {}
    with client.stream("POST", C, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                got = choices.setdefault(c["index"], {"text": "", "logprobs": None, "finish_reason": None})
                got["text"] += c["text"]
                got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
                if c["logprobs"] is not None:
                    lp = got["logprobs"] = got["logprobs"] or {k: [] for k in c["logprobs"]}
                    for k, v in c["logprobs"].items():
                        lp[k] += v
    return choices


@pytest.mark.parametrize("body", [
    {"prompt": [[5, 9, 12, 40, 7], [3, 3, 8]], "logprobs": 1, "max_tokens": 3, "temperature": 0},  # lm-eval's
    {"prompt": TEXT, "logprobs": 2, "max_tokens": 0},
    {"prompt": [TEXT, "a b"], "max_tokens": 4, "temperature": 0},
    {"prompt": TEXT, "logprobs": 1, "max_tokens": 4, "n": 2, "seed": 7, "temperature": 1.0},
], ids=["ids batch", "max_tokens 0", "no logprobs", "n=2 seeded"])
def test_a_streamed_echo_equals_the_whole_reply(client, body):
    """The prompt (and its logprobs) come in each choice's first chunk, then the generated tokens:
    joined, the same text, tokens, logprobs and text offsets as the reply sent whole."""
    body = {**body, "echo": True, "ignore_eos": True}
    whole = client.post(C, json=body)
    assert whole.status_code == 200, whole.text
    streamed = _streamed(client, body)
    choices = whole.json()["choices"]
    assert sorted(streamed) == [c["index"] for c in choices]
    for c in choices:
        got = streamed[c["index"]]
        assert got["text"] == c["text"] and got["finish_reason"] == c["finish_reason"]
        if c["logprobs"] is None:
            assert got["logprobs"] is None
            continue
        for key in ("tokens", "text_offset", "top_logprobs"):
            assert got["logprobs"][key] == c["logprobs"][key], key
        pairs = list(zip(got["logprobs"]["token_logprobs"], c["logprobs"]["token_logprobs"]))
        assert len(pairs) == len(c["logprobs"]["tokens"]) and pairs[0] == (None, None)
        assert all(abs(a - b) < 1e-5 for a, b in pairs[1:])
