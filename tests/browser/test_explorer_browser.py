"""The explorer in a real browser (headless Chromium): the slider and the layer bar show the numbers
`kvstate memory --json --layers` prints, models can be switched or a config.json uploaded, a sent
prompt shows up in the engine view (blocks growing, slot fixed), the step timeline and the cache
reports panel, and the
cache on/off and recall panels draw what the server measured. Screenshots: tmp dir and out/explorer/.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.browser.conftest import keep_screenshot, missing

if (why := missing()) is not None:
    pytest.skip(why, allow_module_level=True)


def cli_memory(model: str, context: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvstate", "memory", model, "--json", "--layers", "--context",
                          str(context)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)[0]


def layer_bytes(per_layer: list[dict], layer: int, context: int) -> int:
    total = 0
    for e in per_layer:
        if e["layer"] == layer:
            total += (e["kv_per_token"]["bytes"] * context if e["kv_per_token"] else 0)
            total += sum(e[k]["bytes"] for k in ("recurrent", "conv") if e[k])
    return total


def shown_context(pg) -> int:
    return int(pg.get_attribute("#context-label", "data-context"))


def wait_context(pg, old: int) -> int:
    pg.wait_for_function(f"document.querySelector('#context-label').dataset.context !== '{old}'", timeout=15_000)
    return shown_context(pg)


def readings(pg) -> dict[str, tuple[int, str]]:
    """kind -> (exact bytes, the text shown) of the slider's readout."""
    rows = pg.query_selector_all("#readings tr")
    return {r.get_attribute("data-kind"): (int(r.get_attribute("data-bytes")), r.query_selector(".exact").inner_text())
            for r in rows}


def test_slider_and_layer_bar_show_the_planners_numbers(page, tmp_path):
    pg = page
    assert pg.input_value("#model-select") == "qwen3.5-0.8b"
    start = shown_context(pg)
    assert start == 32768
    pg.focus("#context-slider")
    for _ in range(4):  # four stops per doubling: 32K -> 64K
        pg.keyboard.press("ArrowRight")
    pg.wait_for_function("document.querySelector('#context-label').dataset.context === '65536'")
    context = shown_context(pg)
    cli = cli_memory("qwen3.5-0.8b", context)
    shown = readings(pg)
    assert shown["actual"][0] == cli["totals"][str(context)]
    assert shown["actual"][1] == f"{cli['totals'][str(context)]:,} B"
    assert shown["gqa"][0] == 24 * 2 * 2 * 256 * 2 * context and shown["mha"][0] == 4 * shown["gqa"][0]

    pg.click("#layer-bar button[data-layer='3']")  # a full-attention layer
    detail = pg.locator("#layer-detail")
    assert detail.get_attribute("data-layer") == "3"
    assert int(detail.get_attribute("data-bytes")) == layer_bytes(cli["per_layer"], 3, context) == 2048 * context
    assert "[2, 2, 256] bfloat16 per token" in detail.inner_text()
    pg.click("#layer-bar button[data-layer='0']")  # a Gated DeltaNet layer: fixed state only
    gdn = next(e for e in cli["per_layer"] if e["layer"] == 0)
    assert int(detail.get_attribute("data-bytes")) == layer_bytes(cli["per_layer"], 0, context)
    assert int(detail.get_attribute("data-kv-bytes")) == 0
    assert f"[{', '.join(map(str, gdn['recurrent']['shape']))}] {gdn['recurrent']['dtype']}" in detail.inner_text()

    pg.focus("#context-slider")
    pg.keyboard.press("End")  # the slider's last stop: the model's window; the clicked layer follows
    longest = wait_context(pg, context)
    cli = cli_memory("qwen3.5-0.8b", longest)
    assert longest == cli["max_position_embeddings"]
    assert readings(pg)["actual"][0] == cli["totals"][str(longest)]
    assert int(detail.get_attribute("data-bytes")) == layer_bytes(cli["per_layer"], 0, longest)
    keep_screenshot(pg, tmp_path, "explorer-memory.png")


def test_switching_models_and_uploading_a_config(page, tmp_path):
    from kvstate.config.reader import load_config

    pg = page
    context = shown_context(pg)
    pg.select_option("#model-select", "jamba-v0.1")
    cli = cli_memory("jamba-v0.1", context)
    pg.wait_for_function(f"document.querySelector('#layer-string').textContent === {json.dumps(cli['layer_string'])}")
    assert readings(pg)["actual"][0] == cli["totals"][str(context)]
    assert pg.locator("#layer-bar button").count() == len(cli["layer_string"])

    upload = tmp_path / "config.json"
    upload.write_text(json.dumps(load_config("kimi-linear-48b-a3b")))
    pg.set_input_files("#config-upload", str(upload))
    cli = cli_memory(str(upload), context)
    pg.wait_for_function(f"document.querySelector('#layer-string').textContent === {json.dumps(cli['layer_string'])}")
    assert readings(pg)["actual"][0] == cli["totals"][str(context)]
    assert pg.inner_text("#memory-error") == ""

    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "no_such_family"}')
    pg.set_input_files("#config-upload", str(bad))
    pg.wait_for_function("document.querySelector('#memory-error').textContent.includes('no_such_family')")


def blocks_of(pg, state: str) -> list[tuple[int, int]]:
    """(cached tokens, KV blocks drawn) of each request row in `state` (running / finished)."""
    return [(int(r.get_attribute("data-computed")), int(r.get_attribute("data-blocks")))
            for r in pg.query_selector_all(f"#requests .req.{state}")]


def test_a_sent_prompt_shows_in_the_engine_view_and_the_timeline(page, live, tmp_path):
    from kvstate.models.tokenizer import Tokenizer

    pg = page
    pg.wait_for_selector("#pools[data-steps]")
    steps_before = int(pg.get_attribute("#pools", "data-steps"))
    block_size = 16
    pg.fill("#prompt-text", "The cache grows")
    pg.fill("#prompt-max", "600")
    pg.fill("#prompt-n", "2")
    pg.click("#prompt-form button")
    # while it runs: a running request whose KV grows block by block next to its one state slot
    pg.wait_for_selector("#requests .req.running", timeout=30_000)
    first = max(blocks_of(pg, "running"))
    pg.wait_for_function(f"[...document.querySelectorAll('#requests .req.running')].some("
                         f"r => Number(r.dataset.blocks) > {first[1]})", timeout=60_000)
    for computed, blocks in blocks_of(pg, "running"):
        assert blocks == math.ceil(computed / block_size)
    assert "slot #" in pg.inner_text("#requests .req.running .slot")
    assert int(pg.get_attribute("#pools", "data-state-slots-used")) >= 1
    keep_screenshot(pg, tmp_path, "explorer-engine.png")

    pg.wait_for_selector("#prompt-status[data-done]", timeout=120_000)
    tok = Tokenizer(live[2])
    lengths = sorted(len(tok.encode(t)) + 600 - 1 for t in ("The cache grows", "The cache grows 1"))
    pg.wait_for_function("document.querySelectorAll('#requests .req.finished').length >= 2")
    pg.wait_for_function("document.querySelector('#pools').dataset.kvBlocksUsed === '0'")
    done = sorted(blocks_of(pg, "finished"))[-2:]
    assert [c for c, _ in done] == lengths
    assert all(b == math.ceil(c / block_size) for c, b in done)
    assert int(pg.get_attribute("#pools", "data-steps")) >= steps_before + 600
    assert pg.locator("#timeline-chart rect").count() > 0
    # the cache panel: the last requests' cache reports (this server runs without prefix caching)
    pg.wait_for_function("document.querySelectorAll('#cache-reports tr.cache-report').length >= 2")
    reasons = {r.get_attribute("data-reason") for r in pg.query_selector_all("#cache-reports tr.cache-report")}
    assert reasons == {"caching_off"} and "caching off" in pg.inner_text("#cache-reports")
    summary = pg.inner_text("#timeline-summary")
    assert "prefill:" in summary and "decode:" in summary


def test_cache_on_off_and_recall_panels(page, live, tmp_path):
    from kvstate.models.tokenizer import Tokenizer

    pg = page
    pg.fill("#cache-prompt", "The cat sat on the")
    pg.fill("#cache-max", "4")
    pg.click("#cache-form button")
    totals = pg.wait_for_selector("#cache-totals", timeout=30_000)
    p = len(Tokenizer(live[2]).encode("The cat sat on the"))
    assert int(totals.get_attribute("data-with")) == p + 3
    assert int(totals.get_attribute("data-without")) == 4 * p + 6
    assert f"{p} + 1 + 1 + 1 = {p + 3}" in totals.inner_text()
    assert f"{p} + {p + 1} + {p + 2} + {p + 3} = {4 * p + 6}" in totals.inner_text()

    pg.select_option("#recall-task", "phonebook")
    pg.fill("#recall-size", "12")
    pg.click("#recall-form button")
    pg.wait_for_selector("#recall-result .hbar", timeout=60_000)
    bars = pg.query_selector_all("#recall-result .hbar")
    assert len(bars) == 5 and len(pg.query_selector_all("#recall-result .hbar.answer")) == 1
    assert all(float(b.get_attribute("data-logprob")) < 0 for b in bars)
    keep_screenshot(pg, tmp_path, "explorer.png")
