"""The benchmarks run end to end in their quick mode and print well-formed JSON (no timing is asserted)."""

import json

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
