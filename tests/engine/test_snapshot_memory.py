"""Snapshot memory you can plan: `kvstate memory --snapshots N` prints what N prefix-cache snapshots
cost (a state slot each, at most one partial KV block each, from the planner's cache spec), and
`snapshot_memory` (LLM, `serve --snapshot-memory`) bounds them: the engine's spare state slots are
the bytes it holds over a slot's bytes, which the engine then really allocates."""

from __future__ import annotations

import json

import pytest

from kvstate import LLM
from kvstate.cache import cache_spec
from kvstate.cli import main
from kvstate.errors import KvstateError
from kvstate.families import read_plan
from tests.engine.test_prefix_caching import path  # noqa: F401  (the four families' checkpoints)


def test_memory_prints_what_n_snapshots_cost(capsys):
    assert main(["memory", "qwen3.5-0.8b", "--snapshots", "8", "--block-size", "4", "--json"]) == 0
    obj = json.loads(capsys.readouterr().out)[0]
    spec = cache_spec(read_plan("qwen3.5-0.8b"))
    assert obj["snapshots"] == {"count": 8, "block_size": 4, "state_bytes": 8 * spec.state_bytes,
                                "partial_kv_bytes_max": 8 * 4 * spec.kv_bytes_per_token,
                                "total_bytes_max": 8 * (spec.state_bytes + 4 * spec.kv_bytes_per_token)}
    assert main(["memory", "qwen3.5-0.8b", "--snapshots", "8"]) == 0
    assert "8 prefix-cache snapshots" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:  # not a count: argparse's one line, exit 2
        main(["memory", "qwen3.5-0.8b", "--snapshots", "0"])
    assert exc.value.code == 2 and "--snapshots" in capsys.readouterr().err


def test_snapshot_memory_bounds_the_spare_slots(path):  # noqa: F811
    probe = LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=3)
    slot = probe.runner.sizes.slot_bytes
    llm = LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=3, enable_prefix_caching=True,
              snapshot_memory=5 * slot + slot // 2)
    assert llm.runner.sizes.num_slots == 3 + 5  # the running sequences' slots, then 5 snapshots
    assert llm.runner.pool_bytes["state"] == 8 * slot
    out = llm.generate([list(range(1, 30))], {"temperature": 0, "max_tokens": 2})[0]
    assert llm.stats()["snapshots_held"] <= 5 and out.finish_reason == "length"
    for bad in (dict(snapshot_memory="1GiB"), dict(snapshot_memory="lots"), dict(snapshot_memory=-1),
                dict(snapshot_memory=slot, num_snapshot_slots=2)):
        with pytest.raises(KvstateError, match="snapshot"):
            LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=3, enable_prefix_caching=True, **bad)
