"""What the scheduler does with a prefix cache: admission from a snapshot, chunk splits, taking snapshots (no torch).

`Scheduler` calls these hooks when prefix caching is on (`PrefixHooks`, over one `PrefixCache`):

- `admit(seq, budget)`: the longest cached prefix of the sequence's tokens becomes its start: the
  full blocks are shared, the partial one copied (copy-on-write), the snapshot's slot copied into
  the sequence's own slot (`SlotManager.copy_slot`: the runner copies before the forward), and
  `num_computed_tokens` starts there. Returns the first chunk's size, or None when it does not fit.
- `capture(seq, step)`: a prefill chunk runs whole; for each snapshot position (below) strictly
  inside it a spare slot is taken and the step asks the linear layers to write the state there
  (`SchedulerOutput.captures`, `kvstate.ops.states_at`), so a first request runs the same chunks
  with or without snapshot points. `limit(seq, n)` still ends a verify entry (speculative
  decoding: drafts may be rejected) at the next snapshot position.
- `computed(seq)`, after each step: full blocks are registered under their hash chain, the
  captured slots become snapshots, and a snapshot is queued (a slot copy) when the sequence stands
  at one of its snapshot positions.
- `keep_final(seq)`: a finished sequence's own slot becomes the snapshot at its end (no copy).
  The scheduler first runs one more entry for the last sampled token (not sampled from), so the
  snapshot holds the whole conversation and the next turn resumes after its last token.

Snapshot positions of a sequence, each with its kind (what /metrics counts hits by):
- "repeat": the prompt's length - 1, so the same prompt sent again computes only its last token
  (with `repeat=False`, "prompt_end": the prompt's end);
- "chat" / "prefix": positions the request names (`Sequence.snapshot_hints`: the end of every chat
  message, rendered by the chat template; a `cache_prefix` the caller passed);
- "interval": multiples of `interval` tokens; "auto" adapts it to the prompt: 256 tokens, doubled
  until the prompt holds at most `AUTO_SNAPSHOTS` of them (a shared document asked about again
  resumes at most one interval before where the new question starts);
- "branch": where this prompt leaves what earlier ones cached, inside a block too (Marconi's
  speculative insertion: the next request with this prefix starts there).
"""

from __future__ import annotations

from kvstate.engine.cache_report import explain
from kvstate.engine.prefix_cache import PrefixCache, Snapshot, block_content, block_hashes, salt_root
from kvstate.engine.sequence import Sequence


AUTO_INTERVAL = 256  # the shortest spacing of "auto" interval snapshots
AUTO_SNAPSHOTS = 8  # "auto" doubles the spacing until a prompt holds at most this many


def auto_interval(num_prompt_tokens: int) -> int:
    """The spacing of "auto" interval snapshots for a prompt: 256, 512, ... (nested grids, so prompts of
    different lengths still share positions)."""
    spacing = AUTO_INTERVAL
    while num_prompt_tokens > AUTO_SNAPSHOTS * spacing:
        spacing *= 2
    return spacing


class PrefixHooks:
    def __init__(self, cache: PrefixCache, *, interval: int | str | None, repeat: bool = True) -> None:
        self.cache, self.interval, self.repeat = cache, interval, repeat
        self.blocks, self.slots, self.bs = cache.blocks, cache.slots, cache.blocks.block_size
        self._chains: dict[Sequence, list[bytes]] = {}  # key chain of the sequence's full blocks so far
        self._registered: dict[Sequence, int] = {}  # leading blocks of its table registered
        self._branch: dict[Sequence, int] = {}  # position where its cached blocks end (a snapshot there)
        self._roots: dict[Sequence, bytes] = {}  # root of its key chains: its cache_salt's
        self._captures: dict[Sequence, list[tuple[int, int, str]]] = {}  # (position, slot, kind) this step

    def _root(self, seq: Sequence) -> bytes:
        root = self._roots.get(seq)
        if root is None:
            root = self._roots[seq] = salt_root(seq.cache_salt)
        return root

    def _chain(self, seq: Sequence, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, self.bs, self._chains.setdefault(seq, []), self._root(seq))

    # -- admission ---------------------------------------------------------------------------
    def admit(self, seq: Sequence, budget: int, now: float, ending: list[Sequence] = (), idle: bool = False
              ) -> int | None:
        """`ending`: finished replies whose end snapshot comes with this step; a sequence that
        continues one of them waits a step for it. `idle`: nothing runs that could free blocks or
        slots, so when resuming from the snapshot found does not fit (it holds what the copies
        need), that snapshot goes and the admission is tried again (else it would wait forever)."""
        tokens = seq.token_ids(0, seq.num_tokens)
        chain, root = self._chain(seq, tokens), self._root(seq)
        # prompt logprobs need every prompt position's logits: such a prefill skips the cache
        full_prompt = seq.prompt_logprobs_missing
        snap = None if full_prompt else self.cache.lookup(tokens, chain, root)
        p = snap.num_tokens if snap is not None else 0
        for f in ending:
            if p < f.num_tokens < seq.num_tokens and f.token_ids(0, f.num_tokens) == tokens[:f.num_tokens]:
                return None
        branch = self.cache.branch_point(tokens, chain, root)
        if p < branch < seq.num_tokens:
            self._branch[seq] = branch
        n = min(seq.num_tokens - p, budget)
        shared = [self.blocks.lookup(h) for h in chain[:p // self.bs]]
        need = self.blocks.blocks_for(p + n) - len(shared)  # new blocks, the copy of a partial one included
        while need > self.blocks.num_free_blocks - self.blocks.num_evictable_among(shared):
            if not self.cache.evict_one(needs_block=True, keep=snap):
                return self._wait(seq, snap, budget, now, ending, idle)
        if not self.slots.can_allocate() and not self.cache.evict_one(keep=snap):
            return self._wait(seq, snap, budget, now, ending, idle)
        seq.state_slot = self.slots.allocate()
        if seq.first_scheduled_time is None:  # first admission: what the request is told it reused
            seq.num_cached_tokens = min(p, seq.num_prompt_tokens)
            st = self.cache.stats
            st.lookups, st.hits = st.lookups + 1, st.hits + (p > 0)
            st.prompt_tokens += seq.num_prompt_tokens
            st.cached_tokens += seq.num_cached_tokens
            if snap is not None:
                st.hits_by_kind[snap.kind] += 1
            seq.cache_report = explain(self.cache, tokens, chain, root, snap, branch, needs_full_prompt=full_prompt)
            if seq.cache_report.reason is not None:
                st.misses_by_reason[seq.cache_report.reason] += 1
            self.cache.seen_root(root)
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

    def _wait(self, seq: Sequence, snap: Snapshot | None, budget: int, now: float, ending, idle: bool) -> int | None:
        """The admission does not fit: wait for running work (None), or when idle, drop the snapshot
        that stands in the way and try again without it."""
        self._branch.pop(seq, None)
        if not idle or snap is None:
            return None
        self.cache.drop(snap, self.cache.policy)
        return self.admit(seq, budget, now, ending, idle)

    def protect(self, waiting) -> None:
        """Evict the snapshots these waiting sequences would resume from last (a request admitted
        first must not take the slot of the one a later request of the same step resumes from)."""
        keys = set()
        for seq in waiting:
            tokens = seq.token_ids(0, seq.num_tokens)
            snap = self.cache.lookup(tokens, self._chain(seq, tokens), self._root(seq))
            if snap is not None:
                keys.add(snap.key)
        self.cache.protected = keys

    def limit(self, seq: Sequence, n: int, start: int | None = None) -> int:
        """`n` cut so that the chunk from `start` (default: the computed tokens) ends at the next snapshot position."""
        c = seq.num_computed_tokens if start is None else start
        stops = [c + n]
        interval = self._interval(seq)
        if interval:
            stops.append((c // interval + 1) * interval)
        stops += [p for p in (self._branch.get(seq), self._prompt_point(seq)) if p is not None and p > c]
        stops += [p for p in seq.snapshot_hints if p > c]
        return min(stops) - c

    def capture(self, seq: Sequence, step, entry: int, now: float) -> None:
        """Ask the step's prefill entry `entry` (seq's chunk) for its state at each snapshot position inside it."""
        c = step.context_lens[entry]
        end = c + step.num_tokens[entry]
        interval = self._interval(seq)
        points = set(range((c // interval + 1) * interval, end, interval)) if interval else set()
        points.update(p for p in (self._branch.get(seq), self._prompt_point(seq), *seq.snapshot_hints) if p is not None)
        root = self._root(seq)
        for p in sorted(p for p in points if c < p < end):
            kind = self._kind(seq, p)
            tokens = seq.token_ids(0, p)
            if kind is None or not self.cache.wants(tokens, p, self._chain(seq, tokens), now, root):
                continue
            slot = self._spare_slot()
            if slot is None:
                return
            self._captures.setdefault(seq, []).append((p, slot, kind))
            step.captures.append((entry, p - c, slot))

    def _interval(self, seq: Sequence) -> int | None:
        return auto_interval(seq.num_prompt_tokens) if self.interval == "auto" else self.interval

    def _prompt_point(self, seq: Sequence) -> int | None:
        """The prompt's own snapshot: its length - 1 (a repeat recomputes the last token), or its end."""
        if not self.repeat:
            return seq.num_prompt_tokens
        return seq.num_prompt_tokens - 1 if seq.num_prompt_tokens > 1 else None

    def _kind(self, seq: Sequence, p: int) -> str | None:
        """Why a snapshot is due at p (None: it is not)."""
        if p == self._prompt_point(seq):
            return "repeat" if self.repeat else "prompt_end"
        if p in seq.snapshot_hints:
            return seq.snapshot_hints[p]
        if p == self._branch.get(seq):
            return "branch"
        interval = self._interval(seq)
        return "interval" if interval and p % interval == 0 else None

    # -- after a step ------------------------------------------------------------------------
    def computed(self, seq: Sequence, now: float) -> None:
        p = seq.num_computed_tokens
        captured = self._captures.pop(seq, None)
        if captured:  # states the step wrote inside its chunk: snapshots unless one came first
            tokens, chain = self._register(seq, snapshot=True)
            root = self._root(seq)
            for q, slot, kind in captured:
                if self.cache.wants(tokens, q, chain, now, root):
                    self.cache.add(tokens, q, chain, seq.block_table, slot, now, kind, root)
                else:
                    self.slots.free(slot)
        kind = self._kind(seq, p)
        if p // self.bs <= self._registered.get(seq, 0) and kind is None:
            return
        tokens, chain = self._register(seq, snapshot=kind is not None)
        root = self._root(seq)
        if kind is not None and self.cache.wants(tokens, p, chain, now, root):
            slot = self._spare_slot()
            if slot is not None:
                self.slots.copy_slot(seq.state_slot, slot)
                self.cache.add(tokens, p, chain, seq.block_table, slot, now, kind, root)

    def keep_final(self, seq: Sequence, now: float) -> Snapshot | None:
        """A finished sequence's slot becomes the snapshot at its computed end (it no longer owns it)."""
        tokens, chain = self._register(seq, snapshot=True)
        p = seq.num_computed_tokens
        snap = None
        root = self._root(seq)
        if seq.state_slot is not None and self.cache.wants(tokens, p, chain, now, root):
            snap = self.cache.add(tokens, p, chain, seq.block_table, seq.state_slot, now, "reply", root)
            seq.state_slot = None
        return snap

    def _register(self, seq: Sequence, snapshot: bool = False) -> tuple[list[int], list[int]]:
        """Register the sequence's new full blocks. Before a snapshot, every block before p is checked:
        one whose content another block held (computed at the same time) may have been evicted since,
        and the sequence's own copy stands in."""
        p = seq.num_computed_tokens
        tokens = seq.token_ids(0, p)
        chain, root = self._chain(seq, tokens), self._root(seq)
        for i in range(0 if snapshot else self._registered.get(seq, 0), p // self.bs):
            content = block_content(tokens, chain, i, self.bs, root)
            if not snapshot or self.blocks.lookup(chain[i], content) is None:
                if self.blocks.register(seq.block_table[i], chain[i], content):
                    self.cache.note_block(chain[i - 1] if i else root, chain[i],
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
        for _, slot, _ in self._captures.pop(seq, ()):
            self.slots.free(slot)
        for d in (self._registered, self._branch, self._chains, self._roots):
            d.pop(seq, None)
