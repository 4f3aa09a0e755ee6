"""Spec 002's lessons in the explorer, in a real browser, on the shipped hybrid (kvstate-phonebook-hybrid):
the decay slider's readout is the document's (0.85 -> 15 tokens at 10%), the per-head horizons are the
gates of the served model recomputed here from its weights, recall shows both shipped models with the
hybrid ahead on a 16-entry phone book, the real-scale timeline's figures are the given bench JSON's,
cache-off takes longer than cache-on for 32 tokens, and the engine panel shows the pools' real shapes.
Screenshots of every panel: out/explorer/lesson-*.png.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from tests.browser.conftest import OUT, missing

if (why := missing()) is not None:
    pytest.skip(why, allow_module_level=True)

SERVED = "kvstate-phonebook-hybrid"
BENCH = {"model": "random Qwen3.5-style 0.5b (0.52B, GGGA...)", "weight_dtype": "bfloat16", "prefill_tokens": 1024,
         "weight_bytes": 987_654_321, "machine": {"threads": 2},
         "rows": [{"impl": "kvstate", "phase": "decode", "batch": 1, "tokens_per_s": 5.0, "ms_per_step": 200.0,
                   "gbps": 5.2, "bandwidth_fraction": 0.3},
                  {"impl": "kvstate", "phase": "prefill", "batch": 1, "tokens_per_s": 1462.857, "ms_per_step": 700.0,
                   "gbps": None, "bandwidth_fraction": None}]}


@pytest.fixture(scope="module")
def live():
    """(base URL, app, checkpoint path) of the explorer serving the shipped hybrid."""
    from kvstate import LLM
    from kvstate.server import explorer
    from kvstate.server.app import create_app
    from kvstate.shipped import model_path
    from tests.browser.server import ServerThread

    llm = LLM(SERVED, cache_memory="16MiB", max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=256)
    app = create_app(llm, model_name=SERVED, routers=[explorer.router])
    with ServerThread(app) as url:
        yield url, app, model_path(SERVED)


def keep_panel(pg, tmp_path, selector: str, name: str) -> None:
    path = tmp_path / name
    pg.locator(selector).screenshot(path=str(path))
    OUT.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, OUT / name)


def reference_horizons(model, ids: list[int]) -> dict[tuple[int, int], int | None]:
    """(layer, head) -> horizon from g = -exp(A_log) * softplus(x W_a^T + dt_bias) (spec 000's gate),
    x the Gated DeltaNet layer's input captured in one forward: the smallest n with mean-decay^n < 0.1."""
    import torch

    from kvstate.models.generate import forward_logits

    seen, hooks = {}, []
    for i, block in enumerate(model.layers):
        if type(block.mixer).__name__ == "GatedDeltaNet":
            hooks.append(block.mixer.register_forward_pre_hook(
                lambda m, args, i=i: seen.__setitem__(i, args[0].clone())))
    forward_logits(model, [ids])
    for h in hooks:
        h.remove()
    out = {}
    with torch.no_grad():
        for i, x in seen.items():
            mix = model.layers[i].mixer
            a = x.float() @ mix.in_proj_a.weight.float().T
            g = -mix.A_log.float().exp() * torch.nn.functional.softplus(a + mix.dt_bias.float())  # [T, H]
            for h, mean in enumerate(g.mean(0).tolist()):
                n = 0
                while n < 10**7 and math.exp(mean * n) >= 0.1:
                    n += 1
                out[(i, h)] = n
    return out


def test_decay_slider_and_the_models_own_horizons(page, live, tmp_path):
    pg = page
    pg.wait_for_selector("#mechanism-panel[data-loaded]", timeout=60_000)
    for decay, tokens in (("0.85", 15), ("0.50", 4), ("0.95", 45)):
        pg.locator("#decay-slider").fill(decay)
        readout = pg.locator("#decay-readout")
        assert readout.get_attribute("data-decay") == decay
        assert int(readout.get_attribute("data-tokens")) == tokens
        assert f"the last {tokens} tokens still hold ≥ 10%" in readout.inner_text()
        assert pg.locator("#decay-bars .wbar.keep").count() == tokens
    pg.locator("#decay-slider").fill("0.85")

    core = live[1].state.engine_loop.core
    prompt = pg.input_value("#gates-prompt")
    ids = core.tokenizer.encode(prompt)[:64]
    expected = reference_horizons(core.model, ids)
    rows = pg.query_selector_all("#gates-heads .gate-row")
    shown = {(int(r.get_attribute("data-layer")), int(r.get_attribute("data-head"))): r.get_attribute("data-horizon")
             for r in rows}
    assert set(shown) == set(expected) and len(shown) == 4  # two GDN layers of two heads
    assert all(shown[k] == str(v) for k, v in expected.items()), (shown, expected)

    # fed token by token: the KV side holds one cell per token per attention layer, the state one slot
    walk = pg.locator("#walk-slider")
    walk.fill("4")
    assert pg.locator("#walk .kv-side").get_attribute("data-cells") == str(5 * 2)
    assert pg.locator("#walk .kv-row").first.locator(".cell").count() == 5
    assert pg.locator("#walk .state-side svg").count() == 1
    assert pg.locator("#walk .state-side").get_attribute("data-layer") == "0"
    pg.select_option("#gates-layer", "2")  # the other Gated DeltaNet layer's slot
    pg.wait_for_selector("#walk .state-side[data-layer='2']", timeout=30_000)
    keep_panel(pg, tmp_path, "#mechanism-panel", "lesson-append-vs-in-place.png")


def test_recall_side_by_side_and_the_real_scale_timeline(page, live, tmp_path):
    pg = page
    pg.wait_for_selector("#recall-second[data-model]", timeout=60_000)  # scored on load: phone book, 16 entries
    assert pg.input_value("#recall-task") == "phonebook" and pg.input_value("#recall-size") == "16"
    served, other = pg.locator("#recall-result"), pg.locator("#recall-second")
    assert served.get_attribute("data-model") == SERVED
    assert other.get_attribute("data-model") == "kvstate-phonebook-linear"
    assert float(served.get_attribute("data-answer-share")) > float(other.get_attribute("data-answer-share"))
    assert "GAGA" in served.inner_text() and "GGGG" in other.inner_text()
    assert served.locator(".hbar").count() == 5 and other.locator(".hbar.answer").count() == 1
    keep_panel(pg, tmp_path, "#recall-panel", "lesson-recall.png")

    pg.select_option("#recall-task", "needle")
    pg.fill("#recall-size", "20")
    pg.click("#recall-form button")
    pg.wait_for_selector("#recall-second .note", timeout=60_000)
    assert "never a needle" in pg.inner_text("#recall-result .note")

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    pg.set_input_files("#scale-upload", str(bench))
    figures = pg.wait_for_selector("#scale-figures", timeout=15_000)
    prefill_ms = 1024 * 1e3 / 1462.857
    want = {"prefill-ms": prefill_ms, "decode-ms": 256 * 200.0, "ttft-ms": prefill_ms + 200.0,
            "total-ms": prefill_ms + 256 * 200.0, "ratio": 200.0 / (1e3 / 1462.857)}
    for key, value in want.items():
        assert float(figures.get_attribute(f"data-{key}")) == pytest.approx(value, rel=1e-9)
    text = pg.inner_text("#scale")
    assert "700.0 ms" in text and "51.20 s" in text and "900.0 ms" in text and "51.90 s" in text
    assert "293×" in text and "98.7%" in text
    keep_panel(pg, tmp_path, "#timeline-panel", "lesson-prefill-vs-decode.png")


def test_cache_off_takes_longer_and_the_pools_real_shapes(page, live, tmp_path):
    pg = page
    prompt = "The cat and the dog run home. The cat is on the road and the dog is in the house."
    pg.fill("#cache-prompt", prompt)
    pg.fill("#cache-max", "32")
    pg.click("#cache-form button")
    times = pg.wait_for_selector("#cache-times", timeout=120_000)
    assert float(times.get_attribute("data-off-ms")) > float(times.get_attribute("data-on-ms")) > 0
    totals = pg.locator("#cache-totals")
    p = len(live[1].state.engine_loop.core.tokenizer.encode(prompt))
    assert int(totals.get_attribute("data-with")) == p + 31
    assert int(totals.get_attribute("data-without")) == sum(p + i for i in range(32))
    keep_panel(pg, tmp_path, "#cache-panel", "lesson-cache-time.png")

    caches = live[1].state.engine_loop.core.runner.caches
    pg.wait_for_function("document.querySelector('#pool-tensors').textContent.includes('block table')")
    shapes = dict((name, shape) for name, shape in json.loads(pg.get_attribute("#pool-tensors", "data-shapes")))
    assert shapes["k"] == list(caches[1].k.shape) and shapes["k"][1:] == [16, 2, 32]
    assert shapes["state"] == list(caches[0].state.shape) and shapes["state"][1:] == [2, 32, 32]
    assert "num_blocks, block_size, kv_heads, head_dim" in pg.inner_text("#pool-tensors")
    keep_panel(pg, tmp_path, "#engine-panel", "lesson-engine-pools.png")
    pg.screenshot(path=str(tmp_path / "explorer-lessons.png"), full_page=True)
    shutil.copy(tmp_path / "explorer-lessons.png", OUT / "explorer-lessons.png")
