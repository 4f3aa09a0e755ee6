"""The benchmarks run end to end in their quick mode and print well-formed JSON (no timing is asserted)."""

import json
import os
import subprocess
import sys

from kvstate.cli import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_bench_ops_quick(capsys):
    out = run_json(capsys, ["bench", "ops", "--quick", "--only", "gated_delta_rule,causal_conv1d", "--json",
                            "--threads", "1"])
    assert out["machine"]["gemm_gflops"] > 0 and out["machine"]["bandwidth_gbps"] > 0
    forms = {(r["op"], r["form"]) for r in out["results"]}
    assert ("gated_delta_rule", "chunk") in forms and ("causal_conv1d", "update") in forms
    assert all(r["ms"] > 0 for r in out["results"])
    assert any(r["speedup"] for r in out["results"])  # the reference ran on the same inputs


def test_bench_model_quick(capsys):
    out = run_json(capsys, ["bench", "model", "--quick", "--prompt-len", "24", "--repeats", "1", "--json",
                            "--threads", "1"])
    assert {r["impl"] for r in out["rows"]} == {"kvstate", "transformers"}
    assert out["last_logits_rel_diff"] < 1e-4  # both sides computed the same thing


def test_bench_engine_quick(capsys):
    out = run_json(capsys, ["bench", "engine", "--quick", "--batches", "1,2", "--prompt-len", "6", "--new-tokens",
                            "3", "--prefill-len", "12", "--json", "--threads", "1"])
    phases = {(r["impl"], r["phase"], r["batch"]) for r in out["rows"]}
    assert ("kvstate", "decode", 2) in phases and ("transformers", "prefill", 1) in phases
    assert set(out["speedup_vs_transformers"]) == {"decode b=1", "decode b=2", "prefill b=1"}


def test_bench_engine_measures_a_given_checkpoint(capsys, tmp_path):
    from kvstate.bench.checkpoints import qwen3_5_checkpoint

    path, _ = qwen3_5_checkpoint("quick", str(tmp_path))
    out = run_json(capsys, ["bench", "engine", "--model", str(path), "--batches", "1", "--prompt-len", "6",
                            "--new-tokens", "3", "--prefill-len", "12", "--json", "--threads", "1"])
    assert out["model"].startswith(path.name + " (")
    assert {(r["impl"], r["phase"]) for r in out["rows"]} >= {("kvstate", "decode"), ("transformers", "prefill")}
    assert set(out["speedup_vs_transformers"]) == {"decode b=1", "prefill b=1"}


def test_bench_engine_without_a_reference_never_imports_transformers(tmp_path):
    # a fresh process: transformers is the test reference, not a run-time dependency (its import
    # alone costs ~0.6 s); a given checkpoint and --no-reference need none of it
    from kvstate.bench.checkpoints import qwen3_5_checkpoint

    path, _ = qwen3_5_checkpoint("quick", str(tmp_path))
    args = ["bench", "engine", "--model", str(path), "--no-reference", "--batches", "1", "--prompt-len", "6",
            "--new-tokens", "3", "--prefill-len", "12", "--json", "--threads", "1"]
    code = ("import sys; from kvstate.cli import main; rc = main(" + repr(args) + "); "
            "assert rc == 0 and 'transformers' not in sys.modules, "
            "sorted(m for m in sys.modules if 'transformers' in m)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["rows"][0]["impl"] == "kvstate"


def test_bench_engine_model_errors_are_one_line(capsys, tmp_path):
    assert main(["bench", "engine", "--model", str(tmp_path / "missing"), "--json"]) == 2
    err = capsys.readouterr().err
    assert "missing: no such file or directory" in err and err.count("\n") == 1


def test_benchmarks_silence_the_fallback_warnings_they_expect():
    # a fresh process: transformers warns once per process, so an earlier test could hide it
    proc = subprocess.run([sys.executable, "-m", "kvstate", "bench", "engine", "--quick", "--batches", "1",
                           "--prompt-len", "4", "--new-tokens", "2", "--prefill-len", "8", "--json", "--threads", "1"],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    assert "falling back" not in proc.stderr and "fast path" not in proc.stderr, proc.stderr
    assert "Writing model shards" not in proc.stderr
    json.loads(proc.stdout)


def test_bench_prompt_logprobs_quick(capsys):
    out = run_json(capsys, ["bench", "prompt-logprobs", "--quick", "--rounds", "1", "--prompt-len", "16", "--json",
                            "--threads", "1"])
    assert [r["kind"] for r in out["rows"]] == ["plain prefill", "prompt_logprobs=1"] and out["ratio"] > 0
