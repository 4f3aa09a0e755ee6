"""Prefix caching for hybrid models: content-addressed KV blocks plus state snapshots (no torch).

A linear layer's state folds all history into one matrix, so a shared prefix can only be reused
where a copy of the state at its last token was kept. Two things make a prefix reusable:

- **KV blocks**: every full block a sequence computes is registered in the `BlockManager` under the
  hash chain of its tokens (`block_hashes`); freed, it stays cached until the LRU needs it. A key is
  sha256 over the parent key and the token ids, the chain rooted in a random per-process seed (as
  vLLM after GHSA-rm76-4mrf-v9r8: Python's hash of ints and tuples is unsalted and can be steered
  into collisions), and a block is shared only when its stored tokens (and parent key) are the
  ones asked for; a snapshot only when its stored prefix tokens are.
- **Snapshots**: a copy of every linear layer's recurrent + conv state at token position `p`, held
  in a spare state slot and keyed by the tokens up to `p` (hash chain of the full blocks before `p`
  plus the tail tokens). Any `p` works: the KV of a partial last block is kept by holding a
  reference to that block (positions < p never change) and a request that resumes there gets its
  own copy of it (copy-on-write), so nothing is rounded to blocks.

`lookup(tokens)` finds the longest prefix (leaving one token to compute) with a snapshot whose
full blocks are all still cached; the scheduler shares those blocks, queues the partial-block copy
and the slot copy, and prefills only the rest. Snapshots are taken by the scheduler at prompt
ends, reply ends (the finished sequence's slot itself), every `snapshot_interval` tokens and at
branch points (the token where a new prompt leaves what earlier ones cached: the end of the shared
cached blocks plus the tokens it shares with a cached block that follows them).

Eviction: KV blocks go least recently used (a snapshot whose blocks are gone is dropped). When a
state slot (or the partial block of a snapshot) is needed, a snapshot is evicted by `policy`:
"lru", or "marconi" (the idea of Marconi, MLSys 2025): recency and the prefill compute a snapshot
saves per byte it holds, both normalized to [0, 1] over the candidates, summed with the saving
weighted `alpha` (higher: a snapshot that saves much prefill outlives fresher cheap ones); the lowest goes,
except that a snapshot which other snapshots extend in one direction only goes first (Marconi keeps
states at branch points and leaves: a request reaching it would most likely go on to the longer one).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from kvstate.engine.block_manager import BlockManager, SlotManager
from kvstate.errors import KvstateError

POLICIES = ("marconi", "lru")
ROOT_KEY = secrets.token_bytes(32)  # the chain's root: keys cannot be computed outside this process
# why a snapshot was taken: a repeat of a prompt (its length - 1), a chat message end, a prefix the
# caller named, an interval, a branch point, a finished reply's end, a prompt's end (repeat=False)
KINDS = ("repeat", "chat", "prefix", "interval", "branch", "reply", "prompt_end")
# why a first admission reused less than it could (kvstate.engine.cache_report explains each)
MISS_REASONS = ("needs_full_prompt", "evicted", "salt_mismatch", "no_snapshot", "no_match")
MAX_EVICTIONS = 1024  # evicted snapshots remembered, so a cache report can say a miss was an eviction
MAX_ROOTS = 16  # salts compared with a request's on a miss, so a report can say another salt holds its tokens


def block_key(parent: bytes, tokens) -> bytes:
    """The key of a full block: sha256 of its parent's key and its token ids (int64 each)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def salt_root(salt: str | None) -> bytes:
    """The chain's root for a request's `cache_salt`: ROOT_KEY without one, else a root of its own, so
    requests with different salts share no block key and no snapshot key (vLLM's `cache_salt`)."""
    if salt is None:
        return ROOT_KEY
    return hashlib.sha256(ROOT_KEY + b"cache_salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


def block_hashes(tokens: list[int], block_size: int, start: list | None = None, root: bytes = ROOT_KEY) -> list[bytes]:
    """The key chain of the full blocks of `tokens`: h_i = block_key(h_{i-1}, block i's tokens), h_-1 =
    `root`. `start`, a chain already computed for a prefix of `tokens`, is extended (not copied)."""
    chain = [] if start is None else start
    for i in range(len(chain), len(tokens) // block_size):
        chain.append(block_key(chain[-1] if chain else root, tokens[i * block_size:(i + 1) * block_size]))
    return chain


def block_content(tokens, chain: list, i: int, block_size: int, root: bytes = ROOT_KEY) -> tuple:
    """What block i of `tokens` holds, as the block manager stores it: (parent key, its tokens)."""
    return chain[i - 1] if i else root, tuple(tokens[i * block_size:(i + 1) * block_size])


def snapshot_key(tokens: list[int], p: int, chain: list[int], block_size: int, root: bytes = ROOT_KEY) -> tuple:
    """Key of the prefix tokens[:p]: the chain hash of its full blocks (the root without one), its tail tokens."""
    full = p // block_size
    return (p, chain[full - 1] if full else root, tuple(tokens[full * block_size:p]))


@dataclass
class Snapshot:
    key: tuple
    num_tokens: int  # the position p: state after tokens[:p]
    slot: int  # the state slot holding the copy
    chain: tuple[int, ...]  # hashes of the full blocks before p (they must stay cached)
    partial_block: int | None  # the block holding tokens [p // bs * bs, p), referenced by the snapshot
    last_used: float
    hits: int = 0
    tokens: tuple[int, ...] = ()  # tokens[:num_tokens]: which other snapshots extend this one
    kind: str = "interval"  # why it was taken (KINDS): hits are counted by it
    root: bytes = ROOT_KEY  # the chain's root: its request's cache_salt (salt_root)
    created: float = 0.0


@dataclass
class PrefixStats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    cached_tokens: int = 0  # of them served from the cache
    lookups: int = 0
    hits: int = 0
    snapshots_taken: int = 0
    snapshots_evicted: int = 0
    hits_by_kind: Counter = field(default_factory=Counter)  # first admissions that resumed, by snapshot kind
    misses_by_reason: Counter = field(default_factory=Counter)  # first admissions that stopped short, by reason


@dataclass(frozen=True)
class Eviction:
    """What a cache report says of an evicted snapshot that would have served a request."""

    position: int
    kind: str
    policy: str  # "marconi", "lru", or "kv_block_lru" (a KV block it needed was reused)
    age: float  # seconds from its taking to its eviction
    time: float  # when it was evicted


class PrefixCache:
    def __init__(self, blocks: BlockManager, slots: SlotManager, *, policy: str = "marconi",
                 flops_per_token: float = 1.0, flops_per_token_pair: float = 0.0, slot_bytes: int = 1,
                 block_bytes: int = 0, align: int = 1, alpha: float = 1.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if policy not in POLICIES:
            raise KvstateError(f"prefix_eviction must be one of {POLICIES}, got {policy!r}")
        self.blocks, self.slots, self.policy = blocks, slots, policy
        self.block_size = blocks.block_size
        # prefill compute of p tokens ~ a p + b p^2 (linear parts, attention): what a snapshot saves
        self.a, self.b, self.alpha = flops_per_token, flops_per_token_pair, alpha
        self.slot_bytes, self.block_bytes = slot_bytes, block_bytes
        self.clock = clock  # the scheduler's: when an eviction happened
        self.align = align  # snapshots only at multiples of this (1: anywhere; 1024: vLLM's blocks)
        self.snapshots: dict[tuple, Snapshot] = {}
        # cached blocks' tokens by parent hash, to find a branch point inside a block: parent -> {hash: tokens}
        self._children: dict[int, dict[int, tuple[int, ...]]] = {}
        self._parent: dict[int, int] = {}
        self.stats = PrefixStats()
        self.evicted: OrderedDict[tuple, Eviction] = OrderedDict()  # the last evictions, for cache reports
        self.roots: OrderedDict[bytes, None] = OrderedDict()  # salts' roots recently admitted, for cache reports
        self.default_root = ROOT_KEY
        self.protected: set[tuple] = set()  # keys of snapshots the next admissions resume from
        blocks.on_evict = self._block_evicted

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, tokens: list[int], chain: list[int], root: bytes = ROOT_KEY) -> Snapshot | None:
        """The snapshot of the longest prefix of `tokens` (shorter than it) whose full blocks are cached
        (`chain`: the key chain of `tokens` under `root`, its salt's)."""
        for p in sorted({s.num_tokens for s in self.snapshots.values()}, reverse=True):
            if p >= len(tokens):
                continue
            snap = self.snapshots.get(snapshot_key(tokens, p, chain, self.block_size, root))
            if snap is not None and snap.root == root and snap.tokens == tuple(tokens[:p]) and all(
                    self.blocks.lookup(h, block_content(tokens, chain, i, self.block_size, root)) is not None
                    for i, h in enumerate(snap.chain)):
                return snap
        return None

    def matched(self, tokens: list[int], chain: list, root: bytes) -> int:
        """How many leading tokens of `tokens` match what is cached under `root`: a snapshot or the blocks."""
        snap = self.lookup(tokens, chain, root)
        return max(snap.num_tokens if snap is not None else 0, self.branch_point(tokens, chain, root))

    def seen_root(self, root: bytes) -> None:
        """A request of this salt's root was admitted (the last MAX_ROOTS are compared on a miss)."""
        self.roots[root] = None
        self.roots.move_to_end(root)
        while len(self.roots) > MAX_ROOTS:
            self.roots.popitem(last=False)

    def best_other_salt(self, tokens: list[int], root: bytes) -> int:
        """The most leading tokens of `tokens` that match under a salt other than `root`'s."""
        return max((self.matched(tokens, block_hashes(tokens, self.block_size, root=r), r)
                    for r in self.roots if r != root), default=0)

    def cached_blocks(self, chain: list, tokens: list[int], root: bytes = ROOT_KEY) -> int:
        """How many leading blocks of `chain` (the chain of `tokens`) are cached holding those tokens."""
        n = 0
        while n < len(chain) and \
                self.blocks.lookup(chain[n], block_content(tokens, chain, n, self.block_size, root)) is not None:
            n += 1
        return n

    def note_block(self, parent: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """Remember the tokens of a block registered under `block_hash` (child of chain hash `parent`)."""
        self._children.setdefault(parent, {})[block_hash] = tokens
        self._parent[block_hash] = parent

    def branch_point(self, tokens: list[int], chain: list[int], root: bytes = ROOT_KEY) -> int:
        """Where `tokens` leave what is cached: the end of its cached leading blocks plus the longest
        run of its next tokens that a cached block after them starts with (token-granular)."""
        n, bs = self.cached_blocks(chain, tokens, root), self.block_size
        tail = tokens[n * bs:(n + 1) * bs]
        best = 0
        for h, block in self._children.get(chain[n - 1] if n else root, {}).items():
            if best < len(tail) and self.blocks.lookup(h) is not None:
                k = 0
                while k < len(tail) and block[k] == tail[k]:
                    k += 1
                best = max(best, k)
        return n * bs + best

    def use(self, snap: Snapshot, now: float) -> tuple[list[int], int | None]:
        """Take a hit: (the shared full blocks, the partial block to copy or None); refreshes recency."""
        snap.last_used, snap.hits = now, snap.hits + 1
        return self.blocks.share([self.blocks.lookup(h) for h in snap.chain]), snap.partial_block

    # -- snapshots ---------------------------------------------------------------------------
    def wants(self, tokens: list[int], p: int, chain: list[int], now: float, root: bytes = ROOT_KEY) -> bool:
        """Whether a snapshot at p is worth taking (allowed position, not held yet: then refreshed)."""
        if p < 1 or p % self.align:
            return False
        snap = self.snapshots.get(snapshot_key(tokens, p, chain, self.block_size, root))
        if snap is not None:
            if snap.tokens == tuple(tokens[:p]):
                snap.last_used = now
            return False  # held, or its key taken by other tokens (a collision): none is taken
        return True

    def add(self, tokens: list[int], p: int, chain: list[int], table: list[int], slot: int, now: float,
            kind: str = "interval", root: bytes = ROOT_KEY) -> Snapshot:
        """Record a snapshot at p held in `slot` (already taken for it); references the partial block of `table`."""
        full = p // self.block_size
        partial = None
        if p % self.block_size:
            partial = self.blocks.share([table[full]])[0]
        snap = Snapshot(snapshot_key(tokens, p, chain, self.block_size, root), p, slot, tuple(chain[:full]), partial,
                        now, tokens=tuple(tokens[:p]), kind=kind, root=root, created=now)
        self.snapshots[snap.key] = snap
        self.evicted.pop(snap.key, None)
        self.stats.snapshots_taken += 1
        return snap

    def drop(self, snap: Snapshot, why: str | None = None) -> None:
        """Forget a snapshot: its slot and partial block go back. `why`: the eviction that chose it
        (the policy, or "kv_block_lru" when a block it needs was reused), remembered for cache reports."""
        del self.snapshots[snap.key]
        self.slots.free(snap.slot)
        if snap.partial_block is not None:
            self.blocks.free([snap.partial_block])
        self.stats.snapshots_evicted += 1
        if why is not None:
            now = self.clock()
            self.evicted[snap.key] = Eviction(snap.num_tokens, snap.kind, why, now - snap.created, now)
            while len(self.evicted) > MAX_EVICTIONS:
                self.evicted.popitem(last=False)

    def evicted_below(self, tokens: list[int], chain: list, root: bytes, start: int) -> Eviction | None:
        """The longest snapshot of a prefix of `tokens` longer than `start` (and shorter than `tokens`)
        that was evicted, as remembered (the last MAX_EVICTIONS evictions)."""
        for key, ev in sorted(self.evicted.items(), key=lambda kv: -kv[1].position):
            p = ev.position
            if start < p < len(tokens) and key == snapshot_key(tokens, p, chain, self.block_size, root):
                return ev
        return None

    def evict_one(self, *, needs_block: bool = False, keep: Snapshot | None = None) -> bool:
        """Evict the least valuable snapshot but `keep`; False if there is none. With `needs_block`,
        only one whose partial block snapshots alone hold (not `keep`): snapshots taken inside one
        block share it, so the block comes free when the last of them goes."""
        if needs_block:
            holders = Counter(s.partial_block for s in self.snapshots.values() if s.partial_block is not None)
            kept = keep.partial_block if keep is not None else None
            cands = [s for s in self.snapshots.values() if s is not keep and s.partial_block is not None
                     and s.partial_block != kept and self.blocks.ref_count(s.partial_block) == holders[s.partial_block]]
        else:
            cands = [s for s in self.snapshots.values() if s is not keep]
        # snapshots that waiting requests will resume from go last (`protected`, set per step)
        cands = [s for s in cands if s.key not in self.protected] or cands
        if not cands:
            return False
        self.drop(min(cands, key=self._scorer(cands)), self.policy)
        return True

    def _scorer(self, cands: list[Snapshot]):
        if self.policy == "lru":
            return lambda s: s.last_used
        inner = self._subsumed(cands)
        lo, hi = min(s.last_used for s in cands), max(s.last_used for s in cands)
        eff = {id(s): self.saved_flops(s.num_tokens) / self.snapshot_bytes(s) for s in cands}
        top = max(eff.values()) or 1.0
        span = (hi - lo) or 1.0
        # a snapshot on the path to exactly one longer one goes first: a request reaching it
        # would most likely continue that way (Marconi keeps states only at branches and leaves)
        return lambda s: (s.last_used - lo) / span + self.alpha * eff[id(s)] / top - 2.0 * (id(s) in inner)

    def _subsumed(self, cands: list[Snapshot]) -> set[int]:
        """ids of the candidates that other snapshots extend in one direction only (not branch points)."""
        held = list(self.snapshots.values())
        out = set()
        for s in cands:
            ways = {x.tokens[s.num_tokens] for x in held if x.num_tokens > s.num_tokens and self._extends(x, s)}
            if len(ways) == 1:
                out.add(id(s))
        return out

    def _extends(self, x: Snapshot, s: Snapshot) -> bool:
        """Whether x's prefix starts with s's: the hash chain of s's full blocks, then its tail tokens
        (at most a block compared, not the whole prefix: this runs per pair at every eviction)."""
        full = len(s.chain)
        if x.root != s.root or (full and x.chain[full - 1] != s.chain[-1]):
            return False
        start = full * self.block_size
        return x.tokens[start:s.num_tokens] == s.tokens[start:]

    def saved_flops(self, p: int) -> float:
        return self.a * p + self.b * p * p

    def snapshot_bytes(self, snap: Snapshot) -> int:
        return self.slot_bytes + (self.block_bytes if snap.partial_block is not None else 0)

    def _block_evicted(self, block: int, block_hash: int) -> None:
        """A cached block was reused: snapshots that need it can no longer be resumed."""
        parent = self._parent.pop(block_hash, None)
        if parent is not None:
            siblings = self._children[parent]
            del siblings[block_hash]
            if not siblings:
                del self._children[parent]
        for snap in [s for s in self.snapshots.values() if block_hash in s.chain]:
            self.drop(snap, "kv_block_lru")

    # -- reporting ---------------------------------------------------------------------------
    def held(self) -> tuple[int, int]:
        """(state slots, KV blocks) that snapshots alone hold: every snapshot's slot, and the partial
        blocks no running sequence references too."""
        holders = Counter(s.partial_block for s in self.snapshots.values() if s.partial_block is not None)
        return len(self.snapshots), sum(1 for b, n in holders.items() if self.blocks.ref_count(b) == n)

    def report(self) -> dict:
        s = self.stats
        held = list(self.snapshots.values())
        return {"prefix_prompt_tokens": s.prompt_tokens, "prefix_cached_tokens": s.cached_tokens,
                "prefix_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                "prefix_lookups": s.lookups, "prefix_hits": s.hits,
                "snapshots_held": len(held), "snapshot_bytes": sum(self.snapshot_bytes(x) for x in held),
                "snapshots_taken": s.snapshots_taken, "snapshots_evicted": s.snapshots_evicted,
                **{f"prefix_hits_{k}": s.hits_by_kind[k] for k in KINDS},
                **{f"prefix_misses_{r}": s.misses_by_reason[r] for r in MISS_REASONS},
                "cached_blocks": self.blocks.num_cached_blocks}
