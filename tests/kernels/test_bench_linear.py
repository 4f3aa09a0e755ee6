"""`kvstate bench linear --quick` runs end to end and prints well-formed JSON (no timing is asserted)."""

import json

from kvstate.cli import main


def test_bench_linear_quick(capsys):
    argv = ["bench", "linear", "--quick", "--rows", "1,3", "--dtypes", "fp32,bf16", "--json", "--threads", "1"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["machine"]["read_gbps"] > 0
    assert {(r["dtype"], r["rows"]) for r in out["rows"]} == {("fp32", 1), ("fp32", 3), ("bf16", 1), ("bf16", 3)}
    assert all(r["ms"] > 0 and r["torch_ms"] > 0 and r["vs_one_row"] > 0 for r in out["rows"])
    assert out["kernels"]["backend"] in ("extension", "torch")
