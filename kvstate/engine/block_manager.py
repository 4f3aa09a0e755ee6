"""Bookkeeping of the two cache pools: paged KV blocks and state slots (no torch).

The tensors live in `kvstate.cache.pools` (KV pools `[num_blocks, block_size, ...]` per
attention layer, state/conv pools `[num_slots, ...]` per linear layer); here we only decide
which ids a sequence owns. One block id or slot id indexes every layer's pool.

- `BlockManager`: a free list and a reference count per block. A sequence's block table is a
  list of ids in token order; `grow` appends blocks until it covers a number of tokens, `free`
  drops one reference per block. `share` adds a reference to blocks in use, so sequences can
  read the same full blocks; a block returns to the free list when its count reaches 0.
  With prefix caching, a full block's content is registered under the hash chain of its tokens
  (`register`, with the content itself: `lookup` given the content it expects compares it, so a
  key collision never hands out another prompt's KV); when its count reaches 0 it stays readable in
  an LRU of evictable blocks until `allocate` needs it (`on_evict` is told), and `lookup` + `share`
  revive it. `copy_block` queues a KV block copy (copy-on-write of a partial block), carried out
  by the runner like slot copies.
- `SlotManager`: free state slots, one per running sequence. `copy_slot` reserves a spare slot
  and queues a copy (src -> dst); the scheduler's next step carries the queued copies
  (`SchedulerOutput.slot_copies`) and the runner carries them out on the tensors before the
  forward: a state snapshot is a slot like any other.

`pool_sizes` turns a cache budget and the memory planner's `CacheSpec` into the pool sizes,
so the bytes the engine allocates are the planner's arithmetic.

Misuse (freeing a free block, allocating past the pool) raises `CacheAccountingError`: that is a
bug in the engine, never user input.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from kvstate.errors import KvstateError


class CacheAccountingError(RuntimeError):
    """A block or slot was used in a way the bookkeeping forbids (an engine bug)."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"num_blocks must be >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # never-used ids are implicit (the next is `_fresh`), so a pool of bookkeeping-only blocks (a model
        # without KV layers: num_slots x max_model_len / block_size ids) costs no Python int per block
        self._fresh = 0
        self._free: deque[int] = deque()  # ids freed since, reused after the fresh ones, oldest first
        self._refs = [0] * num_blocks
        # prefix caching: content hash of full blocks, hash -> block, unreferenced cached blocks (LRU first)
        self._hash: dict[int, int] = {}  # block -> hash
        self._by_hash: dict[int, int] = {}  # hash -> block
        self._content: dict[int, object] = {}  # block -> what it holds (parent key, tokens), when registered with it
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.on_evict: Callable[[int, int], None] | None = None  # (block, hash) when a cached block is reused
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out: free ones and cached ones no sequence references."""
        return self.num_blocks - self._fresh + len(self._free) + len(self._evictable)

    def free_block_ids(self) -> list[int]:
        """The unreferenced, uncached ids in the order `allocate` takes them (for checks; O(num_blocks))."""
        return [*range(self._fresh, self.num_blocks), *self._free]

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a content hash (referenced or not)."""
        return len(self._hash)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_missing(self, table: list[int], num_tokens: int) -> int:
        """New blocks `table` needs to cover `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_missing(table, num_tokens) <= self.num_free_blocks

    def capacity(self, table: list[int]) -> int:
        """Tokens `table` could hold if it took every free block."""
        return (len(table) + self.num_free_blocks) * self.block_size

    def allocate(self, n: int) -> list[int]:
        """Take `n` fresh blocks (reference count 1 each): free ones first, then the least recently
        used cached ones (their content is forgotten)."""
        if n > self.num_free_blocks:
            raise CacheAccountingError(f"asked for {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self._fresh < self.num_blocks:
                b, self._fresh = self._fresh, self._fresh + 1
            elif self._free:
                b = self._free.popleft()
            else:
                b, _ = self._evictable.popitem(last=False)
                h = self._hash.pop(b)
                del self._by_hash[h]
                self._content.pop(b, None)
                if self.on_evict is not None:
                    self.on_evict(b, h)
            self._refs[b] = 1
            out.append(b)
        return out

    def grow(self, table: list[int], num_tokens: int) -> list[int]:
        """Append blocks to `table` (in place) until it covers `num_tokens` tokens; returns the new ids."""
        new = self.allocate(self.blocks_missing(table, num_tokens))
        table.extend(new)
        return new

    def share(self, block_ids: list[int]) -> list[int]:
        """Add a reference to blocks in use or cached (another sequence reads the same KV)."""
        for b in block_ids:
            if self._refs[b] < 1 and b not in self._evictable:
                raise CacheAccountingError(f"cannot share KV block {b}: it is free")
        for b in block_ids:
            self._evictable.pop(b, None)
            self._refs[b] += 1
        return list(block_ids)

    def free(self, table: list[int]) -> None:
        """Drop one reference per block of `table` (last first, so a chain's tail is evicted first) and empty it."""
        for b in reversed(table):
            if self._refs[b] < 1:
                raise CacheAccountingError(f"KV block {b} freed more often than referenced")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash:
                    self._evictable[b] = None  # most recently used end
                else:
                    self._free.append(b)
        table.clear()

    # content addressing (prefix caching) ---------------------------------------------------
    def register(self, block_id: int, block_hash, content=None) -> bool:
        """Record that referenced block `block_id` holds the full block of hash chain `block_hash`
        (`content`: what it holds, compared by `lookup`). False (nothing changes) when that key is
        already registered or the block has a key."""
        if self._refs[block_id] < 1:
            raise CacheAccountingError(f"cannot register KV block {block_id}: it is free")
        if block_hash in self._by_hash or block_id in self._hash:
            return False
        self._hash[block_id], self._by_hash[block_hash] = block_hash, block_id
        if content is not None:
            self._content[block_id] = content
        return True

    def lookup(self, block_hash, content=None) -> int | None:
        """The block registered under `block_hash`, or None; with `content`, None also when the block
        was registered holding something else (a key collision)."""
        b = self._by_hash.get(block_hash)
        if b is not None and content is not None and self._content.get(b, content) != content:
            return None
        return b

    def num_evictable_among(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are cached but unreferenced (sharing them takes them off the free count)."""
        return sum(1 for b in block_ids if b in self._evictable)

    def copy_block(self, src: int) -> int:
        """A fresh block holding a copy of `src`'s KV (queued; the runner copies before the forward)."""
        if self._refs[src] < 1:
            raise CacheAccountingError(f"cannot copy KV block {src}: it is free")
        dst = self.allocate(1)[0]
        self._copies.append((src, dst))
        return dst

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued (src, dst) block copies, in order, and clear the queue."""
        out, self._copies = self._copies, []
        return out


class SlotManager:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used = [False] * num_slots
        self._copies: list[tuple[int, int]] = []

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def in_use(self, slot: int) -> bool:
        return self._used[slot]

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        """A free state slot. Its tensors may hold a previous sequence's state: the model reads a
        sequence with context_len == 0 as starting from zeros, so nothing is cleared here."""
        if not self._free:
            raise CacheAccountingError("no free state slot")
        slot = self._free.popleft()
        self._used[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not (0 <= slot < self.num_slots) or not self._used[slot]:
            raise CacheAccountingError(f"state slot {slot} is not in use")
        self._used[slot] = False
        self._free.append(slot)
        # queued copies stay: they run in order before the next forward, so a copy out of a freed slot
        # still reads what the last forward left there (a snapshot of a sequence preempted since), one
        # into it may feed a copy queued after it (a snapshot taken, hit and evicted in one step), and a
        # slot given out again is either read as zeros (a fresh sequence) or overwritten by a later copy

    def copy_slot(self, src: int, dst: int | None = None) -> int:
        """Queue a copy of slot `src` into `dst` (a fresh spare slot when None); returns dst.
        The scheduler hands the queued copies to the runner in its next step (`take_copies`)."""
        if not (0 <= src < self.num_slots) or not self._used[src]:
            raise CacheAccountingError(f"cannot copy state slot {src}: it is not in use")
        if dst is None:
            dst = self.allocate()
        elif not (0 <= dst < self.num_slots) or not self._used[dst] or dst == src:
            raise CacheAccountingError(f"cannot copy state slot {src} into {dst}: target not a distinct slot in use")
        self._copies.append((src, dst))
        return dst

    def take_copies(self) -> list[tuple[int, int]]:
        """The queued (src, dst) copies, in order, and clear the queue."""
        out, self._copies = self._copies, []
        return out


@dataclass(frozen=True)
class PoolSizes:
    num_blocks: int
    num_slots: int
    block_bytes: int  # KV bytes of one block, all attention layers together
    slot_bytes: int  # state bytes of one slot (recurrent + conv), all linear layers together

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def state_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def total_bytes(self) -> int:
        return self.kv_bytes + self.state_bytes


def pool_sizes(spec, cache_bytes: int, *, block_size: int, num_slots: int, max_model_len: int) -> PoolSizes:
    """Pools for `cache_bytes`: `num_slots` state slots first, every byte left as KV blocks.

    `spec` is a `kvstate.cache.CacheSpec` (kv_bytes_per_token, state_bytes per request). A model
    without KV layers still gets block ids for the bookkeeping (num_slots full-length sequences),
    at zero bytes. Raises KvstateError when the budget cannot hold the slots and one block."""
    slot_bytes, block_bytes = spec.state_bytes, spec.kv_bytes_per_token * block_size
    states = num_slots * slot_bytes
    if block_bytes == 0:
        if states > cache_bytes:
            raise KvstateError(f"--cache-memory: {cache_bytes} bytes cannot hold {num_slots} state slots "
                               f"of {slot_bytes} bytes")
        return PoolSizes(num_slots * -(-max_model_len // block_size), num_slots, 0, slot_bytes)
    num_blocks = (cache_bytes - states) // block_bytes
    if num_blocks < 1:
        raise KvstateError(f"--cache-memory: {cache_bytes} bytes cannot hold {num_slots} state slots of "
                           f"{slot_bytes} bytes plus one KV block of {block_bytes} bytes")
    return PoolSizes(num_blocks, num_slots, block_bytes, slot_bytes)
