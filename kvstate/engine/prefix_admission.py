"""What the scheduler does with a prefix cache: admission from a snapshot, chunk splits, taking snapshots (no torch).

`Scheduler` calls these hooks when prefix caching is on (`PrefixHooks`, over one `PrefixCache`):

- `admit(seq, budget)`: the longest cached prefix of the sequence's tokens becomes its start: the
  full blocks are shared, the partial one copied (copy-on-write), the snapshot's slot copied into
  the sequence's own slot (`SlotManager.copy_slot`: the runner copies before the forward), and
  `num_computed_tokens` starts there. Returns the first chunk's size, or None when it does not fit.
- `limit(seq, n)`: a chunk stops at the next snapshot position: a multiple of `interval`, or the
  branch point (the token where this prompt leaves what earlier ones cached, inside a block too).
- `computed(seq)`, after each step: full blocks are registered under their hash chain, and a
  snapshot is queued (a slot copy) when the sequence stands at a prompt end, an interval or its
  branch point.
- `keep_final(seq)`: a finished sequence's own slot becomes the snapshot at its end (no copy).
  The scheduler first runs one more entry for the last sampled token (not sampled from), so the
  snapshot holds the whole conversation and the next turn resumes after its last token.
"""

from __future__ import annotations

from kvstate.engine.prefix_cache import PrefixCache, Snapshot, block_content, block_hashes
from kvstate.engine.sequence import Sequence


class PrefixHooks:
    def __init__(self, cache: PrefixCache, *, interval: int | None) -> None:
        self.cache, self.interval = cache, interval
        self.blocks, self.slots, self.bs = cache.blocks, cache.slots, cache.blocks.block_size
        self._chains: dict[Sequence, list[bytes]] = {}  # key chain of the sequence's full blocks so far
        self._registered: dict[Sequence, int] = {}  # leading blocks of its table registered
        self._branch: dict[Sequence, int] = {}  # position where its cached blocks end (a snapshot there)

    def _chain(self, seq: Sequence, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, self.bs, self._chains.setdefault(seq, []))

    # -- admission ---------------------------------------------------------------------------
    def admit(self, seq: Sequence, budget: int, now: float, ending: list[Sequence] = ()) -> int | None:
        """`ending`: finished replies whose end snapshot comes with this step; a sequence that
        continues one of them waits a step for it."""
        tokens = seq.token_ids(0, seq.num_tokens)
        chain = self._chain(seq, tokens)
        snap = self.cache.lookup(tokens, chain)
        p = snap.num_tokens if snap is not None else 0
        for f in ending:
            if p < f.num_tokens < seq.num_tokens and f.token_ids(0, f.num_tokens) == tokens[:f.num_tokens]:
                return None
        branch = self.cache.branch_point(tokens, chain)
        if p < branch < seq.num_tokens:
            self._branch[seq] = branch
        n = self.limit(seq, min(seq.num_tokens - p, budget), start=p)
        shared = [self.blocks.lookup(h) for h in chain[:p // self.bs]]
        need = self.blocks.blocks_for(p + n) - len(shared)  # new blocks, the copy of a partial one included
        while need > self.blocks.num_free_blocks - self.blocks.num_evictable_among(shared):
            if not self.cache.evict_one(needs_block=True, keep=snap):
                self._branch.pop(seq, None)
                return None
        if not self.slots.can_allocate() and not self.cache.evict_one(keep=snap):
            self._branch.pop(seq, None)
            return None
        seq.state_slot = self.slots.allocate()
        if seq.first_scheduled_time is None:  # first admission: what the request is told it reused
            seq.num_cached_tokens = min(p, seq.num_prompt_tokens)
            st = self.cache.stats
            st.lookups, st.hits = st.lookups + 1, st.hits + (p > 0)
            st.prompt_tokens += seq.num_prompt_tokens
            st.cached_tokens += seq.num_cached_tokens
        if snap is not None:
            table, partial = self.cache.use(snap, now)
            if partial is not None:
                table.append(self.blocks.copy_block(partial))
            seq.block_table = table
            self.slots.copy_slot(snap.slot, seq.state_slot)
            seq.num_computed_tokens = p
            self._registered[seq] = p // self.bs
        self.blocks.grow(seq.block_table, p + n)
        return n

    def limit(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """`n` cut so that the chunk from `start` (default: the computed tokens) ends at the next snapshot position."""
        c = seq.num_computed_tokens if start is None else start
        stops = [c + n]
        if self.interval:
            stops.append((c // self.interval + 1) * self.interval)
        b = self._branch.get(seq)
        if b is not None and b > c:
            stops.append(b)
        return min(stops) - c

    # -- after a step ------------------------------------------------------------------------
    def computed(self, seq: Sequence, now: float) -> None:
        p = seq.num_computed_tokens
        due = p == seq.num_prompt_tokens or p == self._branch.get(seq) or bool(self.interval and p % self.interval == 0)
        if p // self.bs <= self._registered.get(seq, 0) and not due:
            return
        tokens, chain = self._register(seq, snapshot=due)
        if due and self.cache.wants(tokens, p, chain, now):
            slot = self._spare_slot()
            if slot is not None:
                self.slots.copy_slot(seq.state_slot, slot)
                self.cache.add(tokens, p, chain, seq.block_table, slot, now)

    def keep_final(self, seq: Sequence, now: float) -> Snapshot | None:
        """A finished sequence's slot becomes the snapshot at its computed end (it no longer owns it)."""
        tokens, chain = self._register(seq, snapshot=True)
        p = seq.num_computed_tokens
        snap = None
        if seq.state_slot is not None and self.cache.wants(tokens, p, chain, now):
            snap = self.cache.add(tokens, p, chain, seq.block_table, seq.state_slot, now)
            seq.state_slot = None
        return snap

    def _register(self, seq: Sequence, snapshot: bool = False) -> tuple[list[int], list[int]]:
        """Register the sequence's new full blocks. Before a snapshot, every block before p is checked:
        one whose content another block held (computed at the same time) may have been evicted since,
        and the sequence's own copy stands in."""
        p = seq.num_computed_tokens
        tokens = seq.token_ids(0, p)
        chain = self._chain(seq, tokens)
        for i in range(0 if snapshot else self._registered.get(seq, 0), p // self.bs):
            content = block_content(tokens, chain, i, self.bs)
            if not snapshot or self.blocks.lookup(chain[i], content) is None:
                if self.blocks.register(seq.block_table[i], chain[i], content):
                    self.cache.note_block(chain[i - 1] if i else 0, chain[i],
                                          tuple(tokens[i * self.bs:(i + 1) * self.bs]))
        self._registered[seq] = p // self.bs
        return tokens, chain

    def _spare_slot(self) -> int | None:
        if not self.slots.can_allocate() and not self.cache.evict_one():
            return None
        return self.slots.allocate()

    def reclaim(self, blocks_needed: int) -> None:
        """Evict snapshots holding partial blocks until `blocks_needed` blocks are free (or none is left)."""
        while blocks_needed > self.blocks.num_free_blocks and self.cache.evict_one(needs_block=True):
            pass

    def free_slot(self) -> bool:
        """Whether a state slot is free for an admission, evicting a snapshot if needed."""
        return self.slots.can_allocate() or self.cache.evict_one()

    def release(self, seq: Sequence) -> None:
        """The sequence gave its blocks back (preempted or finished): forget what was kept for it."""
        for d in (self._registered, self._branch, self._chains):
            d.pop(seq, None)
