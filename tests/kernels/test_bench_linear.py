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


def test_bench_linear_int8_and_bad_dtypes(capsys):
    argv = ["bench", "linear", "--quick", "--rows", "1,3", "--json", "--threads", "1"]
    assert main(argv + ["--dtypes", "int8"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["dtype"], r["rows"]) for r in rows] == [("int8", 1), ("int8", 3)] and all(r["ms"] > 0 for r in rows)
    assert main(argv + ["--dtypes", "fp32,int4"]) == 2  # one line, not a KeyError traceback
    err = capsys.readouterr().err
    assert "--dtypes 'fp32,int4'" in err and len(err.strip().splitlines()) == 1
