"""`kvstate bench prefix --quick` runs end to end: four policies, the same replies, well-formed JSON
(no timing is asserted; token counts are)."""

import json

from kvstate.cli import main


def test_bench_prefix_quick(capsys):
    assert main(["bench", "prefix", "--quick", "--json", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    off, aligned, before, ours = out["policies"]
    assert [p["policy"] for p in out["policies"]] == ["off", "aligned", "prompt-end", "kvstate"]
    assert out["replies_identical"]
    assert off["computed_tokens"] == off["prompt_tokens"] and off["cached_tokens"] == 0
    # snapshots at any position reuse more than state kept only at aligned positions
    assert ours["computed_tokens"] <= before["computed_tokens"] < aligned["computed_tokens"] < off["computed_tokens"]
    assert ours["reuse_of_ideal"] > 0.8 and all(p["ttft_later_ms"] > 0 for p in out["policies"])
    serving, shape = out["serving"], out["serving_shape"]
    assert set(serving) == {"doc", "doc-message", "repeat", "system"}
    assert serving["repeat"]["kvstate"]["second_computed"] == 1  # a repeat computes its last token
    assert serving["repeat"]["off"]["second_computed"] == shape["prompt"]
    for workload in ("doc-message", "system"):  # a document or system prompt of its own: only the new message
        assert serving[workload]["kvstate"]["second_computed"] == serving[workload]["kvstate"]["second_own"]
    assert all(serving[w]["off"]["snapshot_bytes"] == 0 for w in serving)
    # every miss has a reason: the first request of each workload found nothing, the second reused all it could
    assert serving["repeat"]["kvstate"]["misses"] == {"no_match": 2}  # the warm-up and the first send
    assert set(serving["doc"]["kvstate"]["misses"]) <= {"no_match", "no_snapshot"}
    first = out["first_request"]
    assert first["prompt"] == 120 and len(first["points"]) == 4 and first["snapshots_taken"] >= 4 * first["rounds"]
    assert len(first["ttft_on_ms"]) == len(first["ttft_off_ms"]) == first["rounds"]
