"""Prefix caching without torch: the block registry, snapshots, eviction, and hypothesis workloads
(random arrivals, lengths, shared prefixes, multi-turn continuations, aborts, a tiny pool) against a
fake model that stores real tokens in fake KV blocks and a running hash in fake state slots. Every
entry checks that its slot and blocks hold exactly its own prefix (a wrong reuse fails there), the
outputs equal the reference, and after every step no block, slot or snapshot leaks or is owned twice."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvstate.engine import SamplingParams, Scheduler, SchedulerConfig
from kvstate.engine.block_manager import BlockManager, SlotManager
from kvstate.engine.prefix_cache import PrefixCache, block_hashes
from tests.engine.test_scheduler import MOD, FakeModel, reference_output


class PrefixFakeModel(FakeModel):
    """FakeModel that carries out the step's slot and block copies and checks each entry's cache."""

    def run(self, sched) -> list[int]:
        for src, dst in sched.slot_copies:
            self.state[dst] = self.state[src]
        for src, dst in sched.block_copies:
            self.kv[dst] = list(self.kv[src])
        for seq, c, table, slot in zip(sched.seqs, sched.context_lens, sched.block_tables, sched.state_slots):
            if c:  # resumes: its slot and blocks must hold exactly its own first c tokens
                tokens = seq.token_ids(0, c)
                h = 0
                for t in tokens:
                    h = (h * 31 + t) % MOD
                assert self.state[slot] == h, (seq.request_id, c)
                assert [self.kv[table[p // self.bs]][p % self.bs] for p in range(c)] == tokens
        return super().run(sched)


def check_prefix_pools(s: Scheduler) -> None:
    """Every block's count is its owners (running + ending sequences, snapshots' partial blocks),
    free blocks are exactly the unowned ones, and slots belong to one sequence or snapshot each."""
    snaps = list(s.prefix.cache.snapshots.values())
    seqs = s.running + s._flushing
    owners = [b for q in seqs for b in q.block_table] + [x.partial_block for x in snaps if x.partial_block is not None]
    for b in range(s.config.num_blocks):
        assert s.blocks.ref_count(b) == owners.count(b), b
    assert s.blocks.num_free_blocks == s.config.num_blocks - len(set(owners))
    slots = [q.state_slot for q in seqs] + [x.slot for x in snaps]
    assert None not in slots and len(slots) == len(set(slots)) and all(s.slots.in_use(x) for x in slots)
    assert s.slots.num_free_slots == s.config.num_slots - len(slots)
    for x in snaps:  # a held snapshot's full blocks are all still cached
        assert all(s.blocks.lookup(h) is not None for h in x.chain)


def run_workload(cfg: SchedulerConfig, seed: int, num_requests: int) -> dict:
    rng = random.Random(seed)
    s, model = Scheduler(cfg), PrefixFakeModel(cfg)
    systems = [[rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    added, done, steps = [], {}, 0
    while len(added) < num_requests or s.has_work():
        while len(added) < num_requests and rng.random() < 0.3:
            finished = [q for q in added if q.finish_reason in ("stop", "length")]
            if finished and rng.random() < 0.4:  # the next turn of a finished conversation
                prev = rng.choice(finished)
                prompt = prev.prompt_token_ids + prev.output_token_ids
            else:
                prompt = list(rng.choice(systems)) if rng.random() < 0.7 else []
            prompt += [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(1, 8))]
            prompt = prompt[: cfg.max_model_len - 2]
            added.append(s.add(len(added), prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 6))))
        if s.running and rng.random() < 0.02:
            s.abort(rng.choice(s.running).request_id)
        sched = s.schedule()
        for f in s.postprocess(sched, model.run(sched)).finished:
            assert f.request_id not in done
            done[f.request_id] = f
        check_prefix_pools(s)
        steps += 1
        assert steps < 100 * num_requests, "the scheduler stopped making progress"
    assert sorted(done) == list(range(num_requests))
    for seq in added:
        want = reference_output(seq.prompt_token_ids, seq.params, cfg)
        n = seq.num_output_tokens if seq.finish_reason == "abort" else len(want)
        assert seq.output_token_ids == want[:n], seq.request_id
    return s.prefix.cache.report()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(12, 40),
       extra_slots=st.integers(0, 4), interval=st.sampled_from([None, 3, 8]),
       policy=st.sampled_from(["marconi", "lru"]), budget=st.integers(3, 12))
# found by hypothesis: two snapshots inside one block shared its partial block, so neither alone
# could free it and a request needing every block waited forever with nothing running
@example(seed=1, block_size=3, num_blocks=12, extra_slots=3, interval=None, policy="lru", budget=3)
# found by a sweep: with nothing running, the only snapshot a request could resume from held the
# partial block its copy needed (resuming did not fit, starting over would): it must go, not wait
@example(seed=7, block_size=2, num_blocks=12, extra_slots=0, interval=None, policy="lru", budget=12)
def test_hypothesis_workloads_are_exact_and_leak_nothing(seed, block_size, num_blocks, extra_slots, interval, policy,
                                                          budget):
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, num_slots=3 + extra_slots,
                          max_model_len=min(40, num_blocks * block_size), vocab_size=29, max_num_seqs=3,
                          max_num_batched_tokens=budget, eos_token_ids=frozenset({0}), enable_prefix_caching=True,
                          snapshot_interval=interval, prefix_eviction=policy)
    run_workload(cfg, seed, num_requests=40)


@pytest.mark.parametrize("policy", ["marconi", "lru"])
def test_a_long_workload_reuses_prefixes_and_evicts(policy):
    cfg = SchedulerConfig(num_blocks=40, block_size=2, num_slots=10, max_model_len=40, vocab_size=29, max_num_seqs=3,
                          max_num_batched_tokens=9, eos_token_ids=frozenset({0}), enable_prefix_caching=True,
                          snapshot_interval=6, prefix_eviction=policy)
    report = run_workload(cfg, 7, num_requests=300)
    assert report["prefix_hits"] > 30 and report["snapshots_evicted"] > 500  # both paths were exercised
    assert 0 < report["prefix_hit_rate"] < 1


def test_block_registry_revives_freed_blocks_and_evicts_least_recently_used():
    bm = BlockManager(3, 2)
    evicted = []
    bm.on_evict = lambda b, h: evicted.append((b, h))
    a, b = bm.allocate(2)
    assert bm.register(a, 11) and bm.register(b, 22) and not bm.register(b, 33) and not bm.register(a, 22)
    bm.free([a])
    bm.free([b])
    assert bm.num_free_blocks == 3 and bm.lookup(11) == a  # freed, still readable
    assert bm.share([a]) == [a] and bm.num_free_blocks == 2  # revived
    (c,) = bm.allocate(1)  # the never-used block first
    assert evicted == [] and c not in (a, b)
    (d,) = bm.allocate(1)  # then the least recently used cached one
    assert d == b and evicted == [(b, 22)] and bm.lookup(22) is None


def test_a_snapshot_needs_its_blocks_and_a_hit_takes_the_longest():
    bm, sm = BlockManager(8, 2), SlotManager(4)
    cache = PrefixCache(bm, sm)
    tokens = [5, 6, 7, 8, 9]
    chain = block_hashes(tokens, 2)
    table = bm.allocate(3)
    for blk, h in zip(table, chain):
        bm.register(blk, h)
    short = cache.add(tokens, 2, chain, table, sm.allocate(), now=1.0)
    long = cache.add(tokens, 5, chain, table, sm.allocate(), now=2.0)  # holds the partial third block
    assert long.partial_block == table[2] and bm.ref_count(table[2]) == 2
    assert cache.lookup(tokens + [1], block_hashes(tokens + [1], 2)) is long
    assert cache.lookup(tokens, chain) is short  # a whole-prompt match leaves one token to compute
    assert cache.lookup([5, 6, 7, 0, 9, 1], block_hashes([5, 6, 7, 0, 9, 1], 2)) is short
    bm.free(table)  # the sequence is gone; blocks cached, the partial one kept by the snapshot
    bm.allocate(bm.num_free_blocks)  # pressure: the tail block goes first (LRU) and `long` with it; its
    assert list(cache.snapshots.values()) == [short] and bm.num_free_blocks == 1  # partial block is handed out
    bm.allocate(1)  # before the last cached block, the first one
    assert cache.snapshots == {} and sm.num_free_slots == 4  # both snapshots lost their blocks: dropped


@pytest.mark.parametrize("policy", ["marconi", "lru"])
def test_snapshots_sharing_a_partial_block_are_evicted_together_for_a_block(policy):
    bm, sm = BlockManager(2, 3), SlotManager(4)
    cache = PrefixCache(bm, sm, policy=policy)
    tokens = [5, 6]
    table = bm.allocate(1)
    one = cache.add(tokens, 1, [], table, sm.allocate(), now=1.0)
    two = cache.add(tokens, 2, [], table, sm.allocate(), now=2.0)
    (block,) = table
    assert one.partial_block == two.partial_block == block
    bm.free(table)  # the sequence is gone: only the two snapshots hold its block
    bm.allocate(1)  # the other block is in use
    assert bm.num_free_blocks == 0 and bm.ref_count(block) == 2
    assert cache.evict_one(needs_block=True) and cache.evict_one(needs_block=True)
    assert cache.snapshots == {} and bm.num_free_blocks == 1 and sm.num_free_slots == 4
    kept = cache.add(tokens, 1, [], bm.allocate(1), sm.allocate(), now=3.0)
    cache.add(tokens, 2, [], [kept.partial_block], sm.allocate(), now=4.0)
    bm.free([kept.partial_block])
    assert not cache.evict_one(needs_block=True, keep=kept)  # evicting the other would free no block


@pytest.mark.parametrize("policy", ["marconi", "lru"])
def test_eviction_policy_weighs_saved_compute_against_recency(policy):
    bm, sm = BlockManager(16, 4), SlotManager(2)
    cache = PrefixCache(bm, sm, policy=policy, flops_per_token=1.0, slot_bytes=100, alpha=2.0)
    long_tokens, short_tokens = list(range(1, 41)), [50, 51, 52, 53]
    for tokens, now in ((long_tokens, 1.0), (short_tokens, 2.0)):
        chain = block_hashes(tokens, 4)
        table = bm.allocate(len(chain))
        for blk, h in zip(table, chain):
            bm.register(blk, h)
        cache.add(tokens, len(tokens), chain, table, sm.allocate(), now)
    cache.evict_one()
    (kept,) = cache.snapshots.values()
    # LRU drops the older long prefix; Marconi keeps it: 40 tokens of prefill saved for the same bytes
    assert kept.num_tokens == (4 if policy == "lru" else 40)


def test_marconi_evicts_a_snapshot_on_the_way_to_one_longer_one_before_a_branch_point():
    """Snapshots at 8 (a shared system prompt: two conversations leave it) and at 16 and 24 of one
    conversation: 16 only leads to 24, so it goes first although it is the newer and saves more."""
    bm, sm = BlockManager(32, 4), SlotManager(4)
    cache = PrefixCache(bm, sm, policy="marconi", flops_per_token=1.0, slot_bytes=100, alpha=1.0)
    system = list(range(1, 9))
    first, second = system + list(range(20, 36)), system + [90, 91, 92, 93]

    def add(tokens, p, now):
        chain = block_hashes(tokens, 4)
        table = bm.allocate(len(chain))
        for blk, h in zip(table, chain):
            bm.register(blk, h)
        cache.add(tokens, p, chain, table, sm.allocate(), now)

    add(first, 8, 1.0)
    add(second, 12, 2.0)
    add(first, 16, 3.0)
    add(first, 24, 0.5)
    cache.evict_one()
    assert sorted(s.num_tokens for s in cache.snapshots.values()) == [8, 12, 24]
