"""The explorer's lesson routes without a browser: the cartoon's stops are the document's readout,
KDA's and Mamba-2's decays are transformers' gates, the real-scale scenario is the bench JSON's
arithmetic (uploaded, given to serve, or from a run started by the page), and bad input is a 400
or one line, never a 5xx or a traceback.
"""

import json
import math
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

pytest.importorskip("fastapi")

import torch  # noqa: E402

from kvstate.errors import KvstateError  # noqa: E402
from kvstate.server import explorer_gates as eg  # noqa: E402
from kvstate.server.explorer_scale import scenario  # noqa: E402
from tests.browser.server import explorer_app, explorer_client, write_checkpoint  # noqa: E402

BENCH = {"model": "random Qwen3.5-style 0.5b", "weight_dtype": "float32", "prefill_tokens": 1024,
         "weight_bytes": 2 * 10**9,
         "machine": {"threads": 2},
         "rows": [{"impl": "transformers", "phase": "decode", "batch": 1, "tokens_per_s": 1.0, "ms_per_step": 1000.0},
                  {"impl": "kvstate", "phase": "decode", "batch": 8, "tokens_per_s": 20.0, "ms_per_step": 400.0},
                  {"impl": "kvstate", "phase": "decode", "batch": 1, "tokens_per_s": 4.0, "ms_per_step": 250.0,
                   "gbps": 8.0},
                  {"impl": "kvstate", "phase": "prefill", "batch": 1, "tokens_per_s": 2048.0, "ms_per_step": 500.0}]}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("lessons"))


@pytest.fixture(scope="module")
def client(ckpt):
    yield from explorer_client(ckpt)


def test_cartoon_stops_are_the_documents_readout():
    stops = {s["decay"]: s["tokens"] for s in eg.cartoon_table()}
    assert stops[0.85] == 15 and stops[0.5] == 4 and stops[0.95] == 45 and len(stops) == 46
    for decay, tokens in stops.items():  # the latest tokens (the newest included) holding >= 10%
        assert tokens == sum(1 for n in range(1000) if decay**n >= 0.1)
    assert eg.horizon(0.0) is None and eg.horizon(-1e-12) is None and eg.horizon(-50.0) == 1


def hooked(module, out: list, output: bool):
    if output:
        return module.register_forward_hook(lambda m, args, res: out.append(res.detach().float()))
    return module.register_forward_pre_hook(lambda m, args: out.append(args[0].detach().float()))


def test_kda_and_mamba2_decays_are_transformers_gates(tmp_path):
    """Per head and layer, the mean log decay over the prompt (KDA: over channels too) equals the one
    transformers' model applies: KDA's forget_gate output, Mamba-2's dt * A from its mixer's input."""
    from tests.models.test_kimi_linear import make as tiny_kimi
    from tests.models.test_mamba2 import tiny as tiny_mamba2

    ids = torch.randint(3, 90, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: no OpenMP oversubscription on a shared machine
    try:
        check_decays(tmp_path, ids, [("kda", tiny_kimi("groups-first2dense")), ("mamba2", tiny_mamba2())])
    finally:
        torch.set_num_threads(threads)


def check_decays(tmp_path, ids, models):
    from kvstate.models.loader import load_model

    for name, hf in models:
        hf.save_pretrained(tmp_path / name)
        model, _ = load_model(tmp_path / name)
        ours = eg.decays(model, ids)
        refs, hooks = [], []
        if name == "kda":
            mods = [layer.self_attn.forget_gate for layer in hf.model.layers if hasattr(layer.self_attn, "forget_gate")]
            hooks = [hooked(m, refs, output=True) for m in mods]
        else:
            mods = [layer.mixer for layer in hf.backbone.layers]
            hooks = [hooked(m, refs, output=False) for m in mods]
        with torch.no_grad():
            hf(torch.tensor([ids]))
        for h in hooks:
            h.remove()
        assert len(ours) == len(refs) == len(mods) >= 2
        for layer, ref, mod in zip(ours, refs, mods):
            if name == "kda":
                g = ref[0]  # [T, H, D]
                assert layer["per_channel"] and layer["kind"] == "KimiDeltaAttention"
                assert [h["slowest_channel_horizon"] for h in layer["heads"]] == \
                    [eg.horizon(float(g[:, h].mean(0).max())) for h in range(g.shape[1])]
                g = g.mean(-1)
            else:
                dt = (ref[0] @ mod.in_proj.weight.float().T)[:, -mod.num_heads:]
                dt = torch.nn.functional.softplus(dt + mod.dt_bias.float()).clamp(*mod.time_step_limit)
                g = -mod.A_log.float().exp() * dt  # [T, H]
                assert not layer["per_channel"] and layer["kind"] == "Mamba2"
            means = g.mean(0).tolist()
            assert [h["mean_log_decay"] for h in layer["heads"]] == pytest.approx(means, rel=1e-4, abs=1e-6)
            assert [h["horizon"] for h in layer["heads"]] == [eg.horizon(m) for m in means]


def test_scenario_is_the_bench_arithmetic():
    s = scenario(BENCH)
    assert s["prefill_ms"] == 1024 * 1e3 / 2048 == 500.0
    assert s["decode_ms"] == 256 * 250.0 and s["ttft_ms"] == 750.0 and s["total_ms"] == 500.0 + 64000.0
    assert s["ratio"] == 250.0 / (1e3 / 2048) and s["decode_share"] == pytest.approx(64000 / 64500)
    assert s["decode_step_bytes"] == 8.0e9 * 0.25 and s["prefill_bytes_per_token"] == 2e9 / 1024
    for bad in ({}, {"rows": [r for r in BENCH["rows"] if r["phase"] != "prefill"]},
                {"rows": [{**r, "tokens_per_s": None} for r in BENCH["rows"]]}):
        with pytest.raises(KvstateError, match="bench result"):
            scenario(bad)


def test_scale_upload_and_a_run_started_from_the_page(client):
    app = client.app_ref
    assert client.get("/explorer/api/scale").json() == {"run": {"status": "idle"}, "scenario": None}
    bad = client.post("/explorer/api/scale", json={"bench": {"rows": []}})
    assert bad.status_code == 400 and "no measured kvstate prefill row" in bad.json()["error"]["message"]
    up = client.post("/explorer/api/scale", json={"bench": BENCH}).json()
    assert up["scenario"] == scenario(BENCH)

    fast = {**BENCH, "rows": [{**r, "ms_per_step": r["ms_per_step"] / 2} for r in BENCH["rows"]]}
    app.state.explorer_bench_runs = True  # kvstate serve --explorer-bench-run
    app.state.explorer_bench_run = None
    app.state.explorer_bench_command = [sys.executable, "-c", f"print({json.dumps(json.dumps(fast))})"]
    assert client.post("/explorer/api/scale/run").json()["run"]["status"] == "running"
    deadline = time.monotonic() + 30
    while (r := client.get("/explorer/api/scale").json())["run"]["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r["run"]["status"] == "done" and r["scenario"] == scenario(fast)

    app.state.explorer_bench_run = None
    app.state.explorer_bench_command = [sys.executable, "-c", "import sys; sys.exit('no model here')"]
    client.post("/explorer/api/scale/run")
    deadline = time.monotonic() + 30
    while (r := client.get("/explorer/api/scale").json())["run"]["status"] == "running" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r["run"] == {"status": "failed", "error": "no model here"} and r["scenario"] == scenario(fast)


def test_a_bench_run_does_not_outlive_the_server(ckpt):
    from fastapi.testclient import TestClient

    app = explorer_app(ckpt)
    app.state.explorer_bench_command = [sys.executable, "-c", "import time; time.sleep(600)"]
    app.state.explorer_bench_runs = True
    with TestClient(app) as c:
        assert c.post("/explorer/api/scale/run").json()["run"]["status"] == "running"
        run = app.state.explorer_bench_run
        deadline = time.monotonic() + 10
        while run.proc is None and time.monotonic() < deadline:
            time.sleep(0.02)
    assert run.proc.wait(timeout=10) != 0  # killed at shutdown


def test_compare_beside_the_other_shipped_model_or_any_checkpoint(client):
    from kvstate.server.explorer_compare import MAX_CACHED

    r = client.post("/explorer/api/compare", json={"task": "phonebook", "size": 4}).json()
    served, other = r["models"]
    assert other["model"] == "kvstate-phonebook-linear" and other["layer_string"] == "GGGG"
    assert other["kv_bytes"] == 0 and other["chat_format"] and other["note"] is None
    assert served["kv_bytes"] > 0 and "does not know" in served["note"]  # a random checkpoint
    for rows in (served["candidates"], other["candidates"]):
        assert rows[0]["text"] == r["answer"] and sum(c["share"] for c in rows) == pytest.approx(1.0)
    name = client.app_ref.state.engine_loop.model_name  # the served model, by its name (never a path)
    mine = client.post("/explorer/api/compare", json={"task": "needle", "size": 3, "other": name}).json()["models"]
    assert mine[0]["candidates"] == mine[1]["candidates"]  # the same checkpoint scores the same
    client.post("/explorer/api/compare", json={"other": "kvstate-phonebook-hybrid", "size": 2})
    assert len(client.app_ref.state.explorer_models.models) == MAX_CACHED  # bounded: the oldest went


def test_bounds_and_bad_input_are_400s(client):
    long = " ".join(["word"] * 300)
    g = client.post("/explorer/api/gates", json={"prompt": long}).json()
    assert g["truncated"] and len(g["tokens"]) == len(g["walk"]) == eg_max()
    assert [h["horizon"] for h in g["layers"][0]["heads"]] == \
        [eg.horizon(h["mean_log_decay"]) for h in g["layers"][0]["heads"]]
    assert g["walk"][-1]["kv_cells"] == len(g["tokens"]) * len(g["attention_layers"])
    for body in ({"prompt": "hi", "layer": 1}, {"prompt": ""}, {"prompt": "hi", "layer": -1}):
        r = client.post("/explorer/api/gates", json=body)
        assert r.status_code == 400, (body, r.text)
    r = client.post("/explorer/api/compare", json={"other": "/no/such/checkpoint"})
    assert r.status_code == 400 and "\n" not in r.json()["error"]["message"]
    for body in ({"size": 0}, {"task": "essay"}, {"size": 257}):
        assert client.post("/explorer/api/compare", json=body).status_code == 400
    assert client.post("/explorer/api/cache/time", json={"prompt": "hi", "max_tokens": 65}).status_code == 400
    assert client.post("/explorer/api/cache/time", json={"prompt": long * 2, "max_tokens": 4}).status_code == 400
    r = client.post("/explorer/api/cache/time", json={"prompt": " ".join(["word"] * 40), "max_tokens": 64})
    assert r.status_code == 400 and "recomputes" in r.json()["error"]["message"]


def eg_max() -> int:
    from kvstate.server.explorer_lessons import MAX_PROMPT_TOKENS

    return MAX_PROMPT_TOKENS


def test_serve_refuses_a_bench_json_it_cannot_use(tmp_path, capsys):
    from kvstate.cli import main

    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"rows": []}))
    for path in (bad, tmp_path / "missing.json"):
        assert main(["serve", "--model", "/no/such/model", "--port", "0", "--bench-json", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--bench-json" in err and "Traceback" not in err, err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(BENCH))
    from kvstate.commands.serve import read_bench_json  # noqa: E402 (the CLI's reader, after its errors)

    assert read_bench_json(str(good)) == BENCH
    assert math.isclose(scenario(read_bench_json(str(good)))["ttft_ms"], 750.0)
