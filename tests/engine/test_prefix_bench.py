"""`kvstate bench prefix --quick` runs end to end: three policies, the same replies, well-formed JSON
(no timing is asserted; token counts are)."""

import json

from kvstate.cli import main


def test_bench_prefix_quick(capsys):
    assert main(["bench", "prefix", "--quick", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    off, aligned, ours = out["policies"]
    assert [p["policy"] for p in out["policies"]] == ["off", "aligned", "kvstate"] and out["replies_identical"]
    assert off["computed_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
    # snapshots at any position reuse more than state kept only at aligned positions
    assert ours["computed_tokens"] < aligned["computed_tokens"] < off["computed_tokens"]
    assert ours["reuse_of_ideal"] > 0.8 and all(p["ttft_later_ms"] > 0 for p in out["policies"])
