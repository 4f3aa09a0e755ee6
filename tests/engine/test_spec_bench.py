"""`kvstate bench spec --quick` runs end to end and prints well-formed JSON (no timing is asserted)."""

import json

from kvstate.cli import main


def test_bench_spec_quick(capsys):
    assert main(["bench", "spec", "--quick", "--ks", "2", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
                 "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["method"]: r for r in out["rows"]}
    assert set(rows) == {"oracle", "ngram", "draft"}
    assert rows["oracle"]["acceptance"] == 1.0 and rows["oracle"]["tokens_per_step"] == 3.0
    assert all(r["exact"] for r in out["rows"])  # every drafter left greedy decoding unchanged
