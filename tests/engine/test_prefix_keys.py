"""Prefix-cache keys (no torch): sha256 chains under a per-process random root, and a key collision
never hands one prompt another prompt's KV blocks or state snapshot (the stored tokens are compared)."""

from __future__ import annotations

from kvstate.engine import SamplingParams, Scheduler, SchedulerConfig
from kvstate.engine import prefix_cache
from kvstate.engine.prefix_cache import ROOT_KEY, block_hashes, block_key
from tests.engine.test_prefix_scheduler import PrefixFakeModel, check_prefix_pools
from tests.engine.test_scheduler import reference_output

CFG = SchedulerConfig(num_blocks=24, block_size=4, num_slots=10, max_model_len=40, vocab_size=50, max_num_seqs=2,
                      max_num_batched_tokens=16, enable_prefix_caching=True, snapshot_interval=4)


def run_alone(s: Scheduler, model, rid, prompt):
    seq = s.add(rid, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while s.has_work():
        step = s.schedule()
        s.postprocess(step, model.run(step))
        check_prefix_pools(s)
    assert seq.output_token_ids == reference_output(prompt, seq.params, CFG)
    return seq


def test_keys_are_sha256_chains_under_a_random_root():
    chain = block_hashes(list(range(1, 10)), 4)
    assert len(chain) == 2 and all(isinstance(h, bytes) and len(h) == 32 for h in chain)
    assert chain[0] == block_key(ROOT_KEY, [1, 2, 3, 4]) and chain[1] == block_key(chain[0], [5, 6, 7, 8])
    assert block_key(ROOT_KEY, [1, 2, 3, 4]) != block_key(ROOT_KEY, [1, 2, 3, 5])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, [chain[0]]) == chain  # extends a started chain


def test_a_key_collision_does_not_share_another_prompts_blocks(monkeypatch):
    # every block gets the same key (and, for the code before sha256 keys, Python's hash too)
    monkeypatch.setattr(prefix_cache, "block_key", lambda parent, tokens: b"same", raising=False)
    monkeypatch.setattr(prefix_cache, "hash", lambda value: 7, raising=False)
    s, model = Scheduler(CFG), PrefixFakeModel(CFG)
    first = run_alone(s, model, "a", list(range(1, 13)))
    assert s.prefix.cache.snapshots  # the first prompt left snapshots (at 4, 8, 11, 12, 15) and cached blocks
    other = run_alone(s, model, "b", list(range(21, 33)))  # the same length, other tokens: colliding keys
    assert other.num_cached_tokens == 0
    again = run_alone(s, model, "c", first.prompt_token_ids)  # the first prompt itself still hits where it can
    assert again.num_cached_tokens >= 4
