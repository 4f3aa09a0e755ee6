"""Prefix caching (snapshot slot copies, shared blocks) and n-gram speculation (verify entries rolled
back on every rank) at TP 2 keep the single-process plain engine's greedy tokens."""

import json
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp

from kvstate.engine.config import EngineConfig
from kvstate.engine.core import EngineCore
from kvstate.llm import LLM
from kvstate.engine.params import SamplingParams
from kvstate.parallel.comm import TPGroup, free_port
from kvstate.parallel.engine import TPRunner
from kvstate.parallel.model import load_shard
from tests.parallel.checkpoints import save_tiny
from tests.parallel.workers import serve

FAMILIES = ["qwen3_5", "kimi_linear"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = [7, 8, 9, 10, 11, 12] * 3 + [20, 21, 22, 23, 24, 25, 26]  # repeats: n-gram drafts find matches


def chat(core) -> list[list[int]]:
    """Two users sharing SYSTEM, each for two turns (turn 2 = turn 1 + reply + more): the replies."""
    replies, history = [], {u: SYSTEM + [30 + u, 31, 32] for u in range(2)}
    for turn in range(2):
        for u in range(2):
            core.add_request((turn, u), history[u], GREEDY)
        done = {}
        while len(done) < 2:
            for out in core.step():
                if out.finished:
                    done[out.request_id] = out.output
        for u in range(2):
            tokens = done[(turn, u)].token_ids
            replies.append(tokens)
            history[u] = history[u] + tokens + [40 + turn, 41]
    return replies


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return [str(save_tiny(f, root / f)) for f in FAMILIES]


def test_prefix_caching_and_ngram_speculation_at_tp2(paths, tmp_path):
    torch.set_num_threads(1)
    reference = [chat(LLM(p, cache_memory="32MiB", max_num_seqs=2).engine) for p in paths]
    port = free_port()
    proc = mp.get_context("spawn").Process(target=serve, args=(1, 2, port, paths, str(tmp_path)), daemon=True)
    proc.start()
    group = TPGroup(0, 2, port, timeout=120)
    for path, ref in zip(paths, reference):
        model, plan = load_shard(path, group)
        config = EngineConfig(cache_memory="32MiB", block_size=4, max_num_seqs=2, snapshot_interval=8,
                              enable_prefix_caching=True, speculative_config={"method": "ngram",
                                                                              "num_speculative_tokens": 3})
        core = EngineCore(model, plan, config=config, runner_class=partial(TPRunner, group=group))
        assert chat(core) == ref, path
        stats = core.stats()
        core.runner.close()
        assert stats["prefix_cached_tokens"] > 0 and stats["snapshots_taken"] > 0, stats
        assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"], stats  # rejected: rolled back
    proc.join(60)
    assert proc.exitcode == 0
    assert set(json.loads((tmp_path / "rank1.json").read_text())) == set(paths)
