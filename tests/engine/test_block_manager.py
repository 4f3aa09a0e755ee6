"""KV block and state slot bookkeeping (torch-free): counts, sharing, misuse, and a random walk
checked against a plain model of who holds what."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvstate.engine.block_manager import BlockManager, CacheAccountingError, SlotManager


def check_blocks(bm: BlockManager, tables: list[list[int]]) -> None:
    """Every block is free exactly once or referenced exactly as often as the tables hold it."""
    held = Counter(b for t in tables for b in t)
    free = bm.free_block_ids()
    assert len(free) == len(set(free)), "a block is on the free list twice"
    assert not held.keys() & set(free), "a held block is on the free list"
    assert len(held) + len(free) == bm.num_blocks, "a block is neither held nor free (leaked)"
    for b in range(bm.num_blocks):
        assert bm.ref_count(b) == held.get(b, 0)
    assert bm.num_free_blocks == len(free) and bm.num_used_blocks == len(held)


def test_grow_covers_tokens_and_free_returns_everything():
    bm = BlockManager(num_blocks=10, block_size=4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    table: list[int] = []
    assert bm.grow(table, 5) == [0, 1] and table == [0, 1]
    assert bm.grow(table, 8) == [] and table == [0, 1]  # the second block still has room
    assert bm.grow(table, 9) == [2]
    assert bm.capacity(table) == 40 and bm.blocks_missing(table, 20) == 2
    other = []
    bm.grow(other, 28)
    assert bm.num_free_blocks == 0 and not bm.can_grow(other, 29) and bm.can_grow(other, 28)
    with pytest.raises(CacheAccountingError, match="asked for 1 KV blocks, 0 free"):
        bm.grow(other, 29)
    check_blocks(bm, [table, other])
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 3
    check_blocks(bm, [other])
    bm.free(other)
    check_blocks(bm, [])


def test_shared_block_returns_to_free_list_only_after_last_reference():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = []
    bm.grow(a, 4)  # blocks 0, 1
    b = bm.share(a[:1])  # another sequence reads block 0 (prefix caching later)
    bm.grow(b, 3)  # and writes its own block after it
    assert bm.ref_count(a[0]) == 2 and bm.ref_count(a[1]) == 1
    check_blocks(bm, [a, b])
    shared = a[0]
    bm.free(a)
    assert bm.ref_count(shared) == 1 and shared not in bm.free_block_ids()
    check_blocks(bm, [b])
    bm.free(b)
    check_blocks(bm, [])


def test_block_misuse_is_refused():
    bm = BlockManager(num_blocks=2, block_size=2)
    t = bm.allocate(1)
    with pytest.raises(CacheAccountingError, match="cannot share KV block 1"):
        bm.share([1])
    copy = list(t)
    bm.free(t)
    with pytest.raises(CacheAccountingError, match="freed more often"):
        bm.free(copy)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=1, block_size=0)


def test_slots_allocate_free_and_refuse_misuse():
    sm = SlotManager(3)
    got = [sm.allocate() for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and not sm.can_allocate()
    with pytest.raises(CacheAccountingError, match="no free state slot"):
        sm.allocate()
    sm.free(1)
    assert sm.num_free_slots == 1 and not sm.in_use(1) and sm.allocate() == 1
    sm.free(2)
    with pytest.raises(CacheAccountingError, match="slot 2 is not in use"):
        sm.free(2)
    with pytest.raises(CacheAccountingError, match="slot 7 is not in use"):
        sm.free(7)
    with pytest.raises(ValueError, match="num_slots"):
        SlotManager(0)


def test_copy_slot_reserves_a_spare_and_queues_the_copy():
    sm = SlotManager(4)
    a = sm.allocate()
    spare = sm.copy_slot(a)  # snapshot into a fresh slot
    assert spare != a and sm.in_use(spare) and sm.num_free_slots == 2
    b = sm.allocate()
    assert sm.copy_slot(spare, b) == b  # roll back into an existing slot
    assert sm.take_copies() == [(a, spare), (spare, b)]
    assert sm.take_copies() == []
    with pytest.raises(CacheAccountingError, match="not in use"):
        sm.copy_slot(3)
    with pytest.raises(CacheAccountingError, match="target"):
        sm.copy_slot(a, a)
    sm.copy_slot(a, b)
    sm.copy_slot(b, spare)
    sm.free(spare)  # queued copies run in order before the next forward, freed slots or not:
    sm.free(a)  # a freed slot still holds what the last forward (or an earlier copy) left there
    assert sm.take_copies() == [(a, b), (b, spare)]


@pytest.mark.parametrize("seed", range(3))
def test_random_walk_never_leaks_or_double_owns(seed):
    rng = random.Random(seed)
    bm, sm = BlockManager(num_blocks=12, block_size=3), SlotManager(5)
    owners: dict[int, tuple[list[int], int]] = {}  # owner -> (block table, slot)
    for step in range(3000):
        op = rng.random()
        if op < 0.35 and sm.can_allocate():
            table = []
            want = rng.randint(1, 12)
            if bm.can_grow(table, want):
                bm.grow(table, want)
                owners[step] = (table, sm.allocate())
        elif op < 0.6 and owners:
            table, _ = owners[rng.choice(list(owners))]
            want = len(table) * 3 + rng.randint(1, 4)
            if bm.can_grow(table, want):
                bm.grow(table, want)
        elif op < 0.7 and owners and sm.can_allocate():
            table, slot = owners[rng.choice(list(owners))]
            shared = bm.share(table[: rng.randint(0, len(table))])
            owners[-step] = (shared, sm.copy_slot(slot))
        elif owners:
            table, slot = owners.pop(rng.choice(list(owners)))
            bm.free(table)
            sm.free(slot)
        check_blocks(bm, [t for t, _ in owners.values()])
        slots = [s for _, s in owners.values()]
        assert len(slots) == len(set(slots)) and all(sm.in_use(s) for s in slots)
        assert sm.num_free_slots + len(slots) == sm.num_slots


def test_pool_sizes_spend_the_budget_as_the_planner_counts():
    from kvstate.cache import cache_spec
    from kvstate.families import read_plan
    from kvstate.engine.block_manager import pool_sizes
    from kvstate.errors import KvstateError

    spec = cache_spec(read_plan("qwen3.5-0.8b"), kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    # 6 full-attention layers x 2 KV heads x 256 x (K, V) x 4 bytes; 18 GDN states of [16, 128, 128] fp32 + conv
    assert spec.kv_bytes_per_token == 6 * 2 * 2 * 256 * 4
    budget = 300 * 2**20
    sizes = pool_sizes(spec, budget, block_size=16, num_slots=8, max_model_len=4096)
    assert sizes.block_bytes == 16 * spec.kv_bytes_per_token and sizes.slot_bytes == spec.state_bytes
    assert sizes.total_bytes <= budget < sizes.total_bytes + sizes.block_bytes  # nothing left that fits a block
    assert sizes.state_bytes == 8 * spec.request_bytes(0)
    assert sizes.kv_bytes == spec.request_bytes(sizes.num_blocks * 16) - spec.state_bytes
    with pytest.raises(KvstateError, match="cannot hold 8 state slots"):
        pool_sizes(spec, 8 * spec.state_bytes, block_size=16, num_slots=8, max_model_len=4096)


def test_pool_sizes_without_kv_layers_give_free_block_ids():
    from types import SimpleNamespace

    from kvstate.engine.block_manager import pool_sizes

    spec = SimpleNamespace(kv_bytes_per_token=0, state_bytes=1000)  # e.g. a pure Mamba-2 model
    sizes = pool_sizes(spec, 10_000, block_size=16, num_slots=4, max_model_len=100)
    assert (sizes.num_blocks, sizes.kv_bytes, sizes.state_bytes) == (4 * 7, 0, 4000)


def test_fresh_ids_come_first_in_order_then_freed_ones_oldest_first():
    bm = BlockManager(4, 2)
    a = bm.allocate(3)
    assert a == [0, 1, 2] and bm.num_free_blocks == 1
    bm.free([a[1]])
    bm.free([a[0]])
    assert bm.num_free_blocks == 3
    assert bm.allocate(3) == [3, 1, 0]  # the never-used id, then the freed ones in the order freed
    assert bm.num_free_blocks == 0


def test_a_large_bookkeeping_pool_holds_no_int_per_block():
    """A model without KV layers gets num_slots x max_model_len / block_size block ids (8M for 32
    sequences of 1M tokens in blocks of 4): the free list must not hold a Python int for each."""
    import tracemalloc

    tracemalloc.start()
    bm = BlockManager(2_000_000, 4)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 24 << 20, peak  # the reference counts (8 bytes a block); a deque of ints was ~90 MB
    assert bm.num_free_blocks == 2_000_000 and bm.allocate(2) == [0, 1]
