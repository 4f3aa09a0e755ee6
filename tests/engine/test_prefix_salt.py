"""`cache_salt` and cache reports without torch: requests with different salts share no block and no
snapshot, the same salt shares as before, and every first admission reports what it reused and,
when it stopped short, why (no snapshot below the match, an eviction by which policy, another salt,
nothing cached), counted by reason in the cache's report."""

from __future__ import annotations

from kvstate.engine import SamplingParams, Scheduler, SchedulerConfig
from kvstate.engine.cache_report import REASONS
from kvstate.engine.prefix_cache import ROOT_KEY, block_hashes, salt_root
from tests.engine.test_prefix_keys import CFG
from tests.engine.test_prefix_scheduler import PrefixFakeModel, check_prefix_pools
from tests.engine.test_scheduler import reference_output

PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
PROMPT = list(range(1, 31))  # 7 full blocks of 4 and a partial one


def run(s: Scheduler, model, rid, prompt, salt=None, cfg=CFG):
    seq = s.add(rid, prompt, PARAMS, cache_salt=salt)
    while s.has_work():
        step = s.schedule()
        s.postprocess(step, model.run(step))
        check_prefix_pools(s)
    assert seq.error is None and seq.output_token_ids == reference_output(prompt, seq.params, cfg)
    return seq


def test_salt_roots_differ_and_no_salt_keeps_the_old_root():
    assert salt_root(None) == ROOT_KEY
    assert len({salt_root(None), salt_root("a"), salt_root("b")}) == 3 and salt_root("a") == salt_root("a")
    assert block_hashes([1, 2, 3, 4], 4, root=salt_root("a")) != block_hashes([1, 2, 3, 4], 4)


def test_different_salts_share_nothing_and_the_same_salt_shares():
    cfg = SchedulerConfig(**{**CFG.__dict__, "num_slots": 40, "num_blocks": 80})  # nothing evicted
    s, model = Scheduler(cfg), PrefixFakeModel(cfg)
    first = run(s, model, "a", PROMPT, salt="tenant-a", cfg=cfg)
    assert first.num_cached_tokens == 0 and first.cache_report.reason == "no_match"
    other = run(s, model, "b", PROMPT, salt="tenant-b", cfg=cfg)
    assert other.num_cached_tokens == 0  # the same 30 tokens, another tenant: nothing shared
    report = other.cache_report
    assert report.reason == "salt_mismatch" and report.other_salt_tokens >= 29 and report.matched_tokens == 0
    assert report.salted
    unsalted = run(s, model, "c", PROMPT, cfg=cfg)
    assert unsalted.num_cached_tokens == 0 and unsalted.cache_report.reason == "salt_mismatch"
    again = run(s, model, "d", PROMPT, salt="tenant-a", cfg=cfg)  # the first tenant's repeat: everything but the last
    assert again.num_cached_tokens == len(PROMPT) - 1 and again.cache_report.reason is None
    assert again.cache_report.source == "repeat" and again.cache_report.shared_blocks == 7
    misses = s.prefix.cache.report()
    assert misses["prefix_misses_salt_mismatch"] == 2 and misses["prefix_misses_no_match"] == 1


def test_a_bad_salt_is_rejected():
    s = Scheduler(CFG)
    for bad in ("", 7):
        seq = s.add(f"x{bad!r}", [1, 2, 3], PARAMS, cache_salt=bad)
        assert seq.error is not None and "cache_salt" in seq.error


def test_no_snapshot_below_the_match_names_the_nearest():
    cfg = SchedulerConfig(**{**CFG.__dict__, "snapshot_interval": None, "eos_token_ids": frozenset()})
    s, model = Scheduler(cfg), PrefixFakeModel(cfg)
    run(s, model, "a", PROMPT, cfg=cfg)  # snapshots at 29 (repeat) and the reply's end only
    other = run(s, model, "b", PROMPT[:20] + [40, 41, 42, 43, 44], cfg=cfg)  # shares 20 tokens: 5 blocks
    r = other.cache_report
    assert r.reused_tokens == 0 and r.matched_tokens == 20
    assert r.reason == "no_snapshot" and r.nearest_snapshot == 0
    # that request took a branch snapshot at 20: the next one that shares it resumes there
    third = run(s, model, "c", PROMPT[:20] + [45, 46], cfg=cfg)
    assert third.cache_report.reused_tokens == 20 and third.cache_report.source == "branch"


def test_an_evicted_snapshot_is_reported_with_its_policy():
    cfg = SchedulerConfig(**{**CFG.__dict__, "num_slots": 3, "max_num_seqs": 1, "snapshot_interval": None})
    s, model = Scheduler(cfg), PrefixFakeModel(cfg)
    run(s, model, "a", PROMPT, cfg=cfg)
    for k in range(4):  # other prompts push the first one's snapshots out of the two spare slots
        run(s, model, f"o{k}", [40 + k] * 9, cfg=cfg)
    again = run(s, model, "b", PROMPT, cfg=cfg)
    r = again.cache_report
    assert r.reason == "evicted" and r.reused_tokens < len(PROMPT) - 1
    assert r.evicted["policy"] in ("marconi", "kv_block_lru") and r.evicted["position"] > r.reused_tokens
    assert r.evicted["age_s"] >= 0 and r.evicted["kind"] in ("repeat", "reply")


def test_every_reason_is_counted_in_the_report():
    s, model = Scheduler(CFG), PrefixFakeModel(CFG)
    run(s, model, "a", PROMPT)
    keys = s.prefix.cache.report()
    assert all(f"prefix_misses_{r}" in keys for r in REASONS if r != "caching_off")
