"""`kvstate memory`: tables, options, JSON equal to the planner's API, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.cache import cache_spec
from kvstate.cli import main
from kvstate.config import BUNDLED, bundled_names
from kvstate.families import read_plan
from kvstate.memory import GIB, fit

ROOT = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    rc = main(["memory", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _json(capsys, *argv):
    rc, out, err = _run(capsys, "--json", *argv)
    assert rc == 0, err
    return json.loads(out)


def test_default_table_lists_every_bundled_model_with_the_documents_figures(capsys):
    rc, out, err = _run(capsys)
    assert rc == 0 and err == ""
    for name in BUNDLED:
        assert name in out
    for printed in ("128 KiB", "61.9 MiB", "184.2 MiB", "74.2 MiB", "7.88 KiB", "41.9 MiB", "15.8 MiB",
                    "137.5 MiB", "2.56 GiB", "5.06 GiB", "3.93 GiB", "7.68 GiB", "6.07 GiB", "2.01 GiB"):
        assert printed in out
    assert "6 A + 18 G" in out and "7:1" in out and "8K" in out and "256K" in out


def test_json_equals_the_planner_api(capsys):
    objs = _json(capsys)
    assert [o["model"] for o in objs] == bundled_names()  # the configs, then the shipped models
    for obj in objs:
        plan = read_plan(obj["model"])
        spec = cache_spec(plan)
        assert obj["layers"] == plan.mixer_counts
        assert obj["kv_bytes_per_token"] == spec.kv_bytes_per_token
        assert obj["recurrent_state_bytes"] == spec.recurrent_state_bytes
        assert obj["conv_state_bytes"] == spec.conv_state_bytes
        assert obj["state_bytes"] == spec.state_bytes == obj["recurrent_state_bytes"] + obj["conv_state_bytes"]
        assert obj["totals"] == {str(c): spec.request_bytes(c) for c in (8192, 131072, 262144)}
    kimi = objs[list(BUNDLED).index("kimi-linear-48b-a3b")]
    assert kimi["totals"]["131072"] == 7 * 576 * 2 * 131072 + 20 * 2 * 1024**2 + 20 * 12288 * 8


def test_options_change_the_numbers(capsys):
    base = _json(capsys, "qwen3.5-0.8b")[0]
    obj = _json(capsys, "qwen3.5-0.8b", "--context", "32k,1m", "--batch", "4", "--kv-dtype", "fp8",
                "--state-dtype", "bf16", "--conv-dtype", "float32", "--conv-window", "kernel-1")[0]
    assert (obj["kv_dtype"], obj["state_dtype"], obj["conv_dtype"]) == ("float8_e4m3fn", "bfloat16", "float32")
    assert obj["kv_bytes_per_token"] * 2 == base["kv_bytes_per_token"]
    assert obj["recurrent_state_bytes"] * 2 == base["recurrent_state_bytes"] == 18 * 1024**2
    assert obj["conv_state_bytes"] == 18 * 6144 * 3 * 4
    assert list(obj["totals"]) == ["32768", "1048576"]
    assert obj["totals"]["32768"] == obj["kv_bytes_per_token"] * 32768 + obj["state_bytes"]
    assert obj["batch_totals"] == {k: 4 * v for k, v in obj["totals"].items()}
    rc, out, _ = _run(capsys, "qwen3.5-0.8b", "--context", "32k,1m", "--batch", "4")
    assert rc == 0 and "32K x4" in out and "1M x4" in out and "longer than the model" in out


def test_layers_breakdown(capsys):
    rc, out, _ = _run(capsys, "qwen3.5-0.8b", "--layers")
    assert rc == 0
    assert "GGGA" * 6 in out
    assert "[16, 128, 128] float32" in out and "[6144, 4] bfloat16" in out
    obj = _json(capsys, "nemotron-nano-9b-v2", "--layers")[0]
    rows = obj["per_layer"]
    assert sum(r["recurrent"]["bytes"] for r in rows if r["recurrent"]) == obj["recurrent_state_bytes"]
    assert sum(r["kv_per_token"]["bytes"] for r in rows if r["kv_per_token"]) == obj["kv_bytes_per_token"]
    assert {r["kind"] for r in rows} == {"mamba2", "attention"} and len(rows) == 31


def test_gpu_memory(capsys, tmp_path):
    obj = _json(capsys, "qwen3-next-80b-a3b", "llama-3.1-8b", "--gpu-memory", "192GiB")
    for o in obj:
        plan = read_plan(o["model"])
        expected = fit(plan, cache_spec(plan), 192 * GIB, (8192, 131072, 262144)).as_json()
        assert o["gpu"] == expected
    llama = obj[1]["gpu"]
    assert llama["weight_bytes"] == 8_030_261_248 * 2
    assert llama["max_requests"]["131072"] == (192 * GIB - 8_030_261_248 * 2) // (16 * GIB)
    decimal = _json(capsys, "llama-3.1-8b", "--gpu-memory", "80GB")[0]["gpu"]
    assert decimal["gpu_bytes"] == 80 * 10**9
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((ROOT / "kvstate/data/configs/jamba-v0.1.json").read_text())
    (ckpt / "model.safetensors").write_bytes(b"\0" * 4096)
    disk = _json(capsys, str(ckpt), "--gpu-memory", "1G")[0]["gpu"]
    assert (disk["weight_bytes"], disk["weight_source"]) == (4096, "safetensors")
    rc, out, _ = _run(capsys, "jamba-v0.1", "qwen3.5-0.8b", "--gpu-memory", "80GiB")
    assert rc == 0 and "Requests that fit in 80 GiB" in out and "weights do not fit" in out
    assert "(model limit)" in out


def test_plot_option(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    target = tmp_path / "growth.png"
    rc, out, _ = _run(capsys, "qwen3.5-0.8b", "--plot", str(target))
    assert rc == 0 and target.read_bytes()[:4] == b"\x89PNG" and f"wrote {target}" in out


@pytest.mark.parametrize("argv,needle", [
    (["no-such-model"], "no-such-model: no such file or directory, and not a bundled model"),
    (["--context", "32q"], "--context: cannot read '32q'"),
    (["--gpu-memory", "lots"], "--gpu-memory: cannot read 'lots'"),
    (["--kv-dtype", "int3"], "--kv-dtype: unknown dtype 'int3'"),
    (["qwen3.5-0.8b", "--plot", "chart.pdf"], "must end in .png or .svg"),
])
def test_errors_are_one_line_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.startswith("kvstate memory: error: ") and needle in err
    assert err.count("\n") == 1


def test_bad_config_file_names_file_and_field(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "nemotron_h", "hidden_size": 0}))
    rc, _, err = _run(capsys, str(path))
    assert rc == 2 and f"{path}: field '" in err and err.count("\n") == 1


def test_subprocess_exit_code_no_traceback_no_torch(tmp_path):
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "qwen3_next", "hidden_size": 2048,')
    proc = subprocess.run([sys.executable, "-m", "kvstate", "memory", str(broken)], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert f"{broken}: malformed JSON at line 1" in proc.stderr
    code = ("import sys\nfrom kvstate.cli import main\nrc = main(['memory', '--layers'])\n"
            "assert rc == 0 and 'torch' not in sys.modules and 'transformers' not in sys.modules\n")
    ok = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "qwen3.5-0.8b" in ok.stdout


def test_a_bf16_checkpoint_says_which_dtype_the_engines_pools_use(capsys):
    from kvstate.cache.spec import ENGINE_POOL_DTYPES

    rc, out, _ = _run(capsys, "qwen3.5-0.8b")  # planned in bfloat16, the model's dtype
    assert rc == 0 and "kv bfloat16" in out
    assert "own engine (generate, serve, bench) keeps KV in float32" in " ".join(out.split())
    assert "2x the KV above in bfloat16" in " ".join(out.split())
    rc, out, _ = _run(capsys, "qwen3.5-0.8b", "--kv-dtype", "float32")  # the engine's own figures: no note
    assert rc == 0 and "own engine" not in out
    assert _json(capsys, "qwen3.5-0.8b")[0]["engine_pool_dtypes"] == ENGINE_POOL_DTYPES

