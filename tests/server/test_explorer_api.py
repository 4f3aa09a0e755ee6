"""The explorer's API without a browser: the planner's numbers for every bundled model against
`kvstate memory --json --layers`, an uploaded config, the step timeline and cache on/off from the
engine's real steps (chunked prefill included), recall log-probs against transformers, and bad
input answered with a 400, never a 5xx.
"""

import json
import math
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.browser.server import CHUNK, MODEL_NAME, explorer_client, wait_idle, write_checkpoint

CONTEXTS = (8192, 131072)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("explorer"))


@pytest.fixture(scope="module")
def client(ckpt):
    yield from explorer_client(ckpt)


@pytest.fixture(scope="module")
def cli_memory():
    """`kvstate memory --json --layers` for every bundled model, as a user would run it."""
    out = subprocess.run([sys.executable, "-m", "kvstate", "memory", "--json", "--layers",
                          "--context", ",".join(map(str, CONTEXTS))], capture_output=True, text=True, check=True)
    return {m["model"]: m for m in json.loads(out.stdout)}


def layer_bytes(per_layer: list[dict], layer: int, context: int) -> int:
    """A layer's cache at `context`, written out from the CLI's per-entry shapes and bytes."""
    total = 0
    for e in per_layer:
        if e["layer"] == layer:
            total += (e["kv_per_token"]["bytes"] * context if e["kv_per_token"] else 0)
            total += sum(e[k]["bytes"] for k in ("recurrent", "conv") if e[k])
    return total


def test_memory_view_equals_the_cli_for_every_bundled_model(client, cli_memory):
    models = client.get("/explorer/api/models").json()
    assert models["loaded"] == MODEL_NAME and set(models["bundled"]) == set(cli_memory)
    for name, cli in cli_memory.items():
        for context in CONTEXTS:
            v = client.get("/explorer/api/memory", params={"model": name, "context": context}).json()
            assert v["context"] == context and v["layer_string"] == cli["layer_string"]
            assert v["memory"]["per_layer"] == cli["per_layer"]
            assert v["memory"]["totals"] == {str(context): cli["totals"][str(context)]}
            actual = [r for r in v["readings"] if r["kind"] == "actual"]
            assert [r["bytes"] for r in actual] == [cli["totals"][str(context)]]
            assert [row["bytes"] for row in v["layers"]] == [layer_bytes(cli["per_layer"], i, context)
                                                             for i in range(len(cli["layer_string"]))]
            assert sum(row["bytes"] for row in v["layers"]) == cli["totals"][str(context)]
            for c in v["curves"]:  # the slider's stops carry the same arithmetic as the reading
                assert all(b == c["per_token"] * t + c["fixed"] for t, b in c["points"])


def test_qwen3_5_0_8b_worked_numbers_of_the_walkthrough(client):
    """Spec 002: 2048 B per token per full layer, 64 MiB per full layer at 32K, 1.5 GiB if all 24
    layers were GQA (8 query heads: 6 GiB as MHA); full layers at 3, 7, ..., 23."""
    v = client.get("/explorer/api/memory", params={"model": "qwen3.5-0.8b", "context": 32768}).json()
    assert v["layer_string"] == "GGGA" * 6
    full = [row for row in v["layers"] if row["letter"] == "A"]
    assert [row["index"] for row in full] == list(range(3, 24, 4))
    assert {row["bytes"] for row in full} == {64 << 20}
    assert full[0]["entries"][0]["kv_per_token"] == {"shape": [2, 2, 256], "dtype": "bfloat16", "bytes": 2048}
    readings = {r["kind"]: r["bytes"] for r in v["readings"]}
    assert readings["gqa"] == 3 << 29 and readings["mha"] == 6 << 30
    assert 32768 in v["stops"] and v["stops"] == sorted(v["stops"])


def test_an_uploaded_config_is_planned_like_the_bundled_one(client):
    from kvstate.config.reader import load_config

    config = load_config("jamba-v0.1")
    up = client.post("/explorer/api/memory", json={"config": config, "context": 8192}).json()
    named = client.get("/explorer/api/memory", params={"model": "jamba-v0.1", "context": 8192}).json()
    assert up["layers"] == named["layers"] and [r["bytes"] for r in up["readings"]] == [
        r["bytes"] for r in named["readings"]]


@pytest.mark.parametrize("request_args", [
    ("get", {"params": {"model": "no-such-model"}}),
    ("get", {"params": {"context": 0}}),
    ("get", {"params": {"context": -5}}),
    ("get", {"params": {"context": 10**12}}),
    ("get", {"params": {"context": "32k"}}),
    ("post", {"json": {"config": []}}),
    ("post", {"json": {"config": {"model_type": "nope"}}}),
    ("post", {"json": {"config": {"model_type": "qwen3_5", "text_config": "x"}}}),
    ("post", {"json": {"config": {"model_type": "llama", "num_hidden_layers": -1}}}),
    ("post", {"content": b"{not json", "headers": {"content-type": "application/json"}}),
])
def test_bad_memory_requests_are_one_line_400s(client, request_args):
    method, kw = request_args
    r = getattr(client, method)("/explorer/api/memory", **kw)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message and "\n" not in message


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(config=st.dictionaries(st.sampled_from(["model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                               "num_key_value_heads", "head_dim", "layer_types", "text_config",
                                               "vocab_size", "torch_dtype", "max_position_embeddings"]),
                              st.one_of(st.sampled_from(["qwen3_5", "llama", "jamba", "mamba2", "kimi_linear"]),
                                        st.integers(-3, 4096), st.none(), st.lists(st.text(max_size=3), max_size=3),
                                        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))),
       context=st.one_of(st.none(), st.integers(-10, 1 << 23)))
def test_no_uploaded_config_makes_a_5xx(client, config, context):
    r = client.post("/explorer/api/memory", json={"config": config, "context": context})
    assert r.status_code in (200, 400), r.text


def engine_view(client, since=-1):
    return client.get("/explorer/api/engine", params={"since": since}).json()


def test_the_timeline_records_each_step_of_a_chunked_prefill_and_its_decodes(client):
    wait_idle(client.app_ref)
    first = engine_view(client)["view"]
    before, totals = first["num_steps"], first["step_totals"]
    prompt = list(range(3, 3 + CHUNK + 36))  # 100 tokens: two prefill chunks
    r = client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 5,
                                             "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    wait_idle(client.app_ref)
    data = engine_view(client, since=before - 1)
    steps = data["timeline"]
    assert [s["tokens"] for s in steps] == [CHUNK, 36, 1, 1, 1, 1]
    assert [s["prefill_tokens"] for s in steps] == [CHUNK, 36, 0, 0, 0, 0]
    assert [s["decode_tokens"] for s in steps] == [0, 0, 1, 1, 1, 1]
    assert all(s["ms"] > 0 and len(s["entries"]) == 1 for s in steps)
    view = data["view"]
    assert view["num_steps"] == before + 6 and view["kv_blocks_used"] == 0 and view["state_slots_used"] == 0
    grew = {k: {f: view["step_totals"][k][f] - totals[k][f] for f in ("steps", "tokens")} for k in totals}
    assert grew == {"prefill": {"steps": 2, "tokens": 100}, "decode": {"steps": 4, "tokens": 4}}
    last = view["finished"][0]  # its blocks and slot as the last step held them
    assert last["computed"] == 104 and len(last["blocks"]) == math.ceil(104 / view["block_size"])
    assert last["finish_reason"] == "length" and last["id"] == steps[0]["entries"][0]["id"]


@pytest.mark.parametrize("repeat", [1, 3])
def test_cache_on_off_counts_positions_from_the_engine_steps(client, ckpt, repeat):
    from kvstate.models.tokenizer import Tokenizer

    prompt = "The cat sat on the" + " mat and the rug" * (repeat * 4)
    p = len(Tokenizer(ckpt).encode(prompt))
    r = client.post("/explorer/api/cache", json={"prompt": prompt, "max_tokens": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["prompt_tokens"] == p and out["output_tokens"] == 3
    chunks = [CHUNK] * (p // CHUNK) + ([p % CHUNK] if p % CHUNK else [])
    assert (len(chunks) > 1) == (repeat == 3)
    assert [s["with_cache"] for s in out["steps"]] == chunks + [1, 1]
    want = [sum(chunks[: i + 1]) for i in range(len(chunks))] + [p + 1, p + 2]
    assert [s["without_cache"] for s in out["steps"]] == want
    assert out["with_cache_total"] == p + 2
    assert out["without_cache_total"] == sum(s["without_cache"] for s in out["steps"])


def test_recall_log_probs_equal_transformers(client, ckpt):
    import torch
    from transformers import AutoModelForCausalLM

    from kvstate.models.tokenizer import Tokenizer

    for task, size in (("needle", 6), ("phonebook", 8)):
        r = client.post("/explorer/api/recall", json={"task": task, "size": size, "seed": 3})
        assert r.status_code == 200, r.text
        out = r.json()
        texts = [c["text"] for c in out["candidates"]]
        assert out["answer"] in texts and len(set(texts)) == len(texts) == 5
        assert all(t.isdigit() and len(t) == len(out["answer"]) for t in texts)
        assert abs(sum(c["share"] for c in out["candidates"]) - 1) < 1e-9
        hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        tok = Tokenizer(ckpt)
        ids = tok.encode(out["prompt"])
        assert out["prompt_tokens"] == len(ids)
        for c in out["candidates"]:
            cand = tok.encode(c["text"], add_special_tokens=False)
            with torch.no_grad():
                logits = hf(torch.tensor([ids + cand])).logits[0].double()
            logp = torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(cand)], -1)
            ref = float(logp[torch.arange(len(cand)), torch.tensor(cand)].sum())
            assert abs(c["logprob"] - ref) <= 1e-3 * max(1.0, abs(ref)), (c, ref)


@pytest.mark.parametrize("path,body", [
    ("recall", {"task": "haystack"}),
    ("recall", {"task": "needle", "size": 0}),
    ("recall", {"task": "phonebook", "size": 521}),
    ("recall", {"task": "needle", "size": 2000}),  # far past the served 1024 tokens
    ("recall", {"task": "needle", "depth": 2}),
    ("cache", {"prompt": ""}),
    ("cache", {"prompt": "hi", "max_tokens": 0}),
    ("cache", {"prompt": "hi", "max_tokens": 1000}),
    ("cache", {"prompt": "the quick brown fox " * 400}),  # longer than max_model_len
    ("cache", {"max_tokens": 3}),
])
def test_bad_cache_and_recall_requests_are_400s(client, path, body):
    r = client.post(f"/explorer/api/{path}", json=body)
    assert r.status_code == 400, r.text
    assert "\n" not in r.json()["error"]["message"]


def test_the_planner_and_recorder_modules_import_no_torch():
    code = ("import sys, kvstate.server.explorer_memory, kvstate.server.explorer_engine; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_explorer_api_is_not_in_the_openapi_schema_but_the_page_is_served(client):
    assert not [p for p in client.get("/openapi.json").json()["paths"] if p.startswith("/explorer")]
    page = client.get("/")
    assert page.status_code == 200 and "kvstate explorer" in page.text
    for asset in ("explorer.css", "common.js", "memory.js", "engine.js", "experiments.js"):
        assert client.get(f"/{asset}").status_code == 200
