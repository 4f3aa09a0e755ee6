"""What prefix caching did for one request, and why it stopped where it did (no torch).

Every request's output carries a `CacheReport` (`RequestOutput.cache_report`; in HTTP replies the
`kvstate_cache` object beside `usage`). It says how many prompt tokens matched anything cached
(KV blocks or a snapshot, under the request's `cache_salt`), how many were reused, from which
snapshot, and, when reuse stopped short of the prompt's length - 1 (the most a request can reuse:
its last token is computed to sample from), the first of these reasons that applies:

- "caching_off": the engine runs without prefix caching;
- "needs_full_prompt": a sampling parameter needs every prompt position computed (prompt logprobs);
- "evicted": a snapshot of a longer prefix was held and evicted (`evicted` says by which policy,
  "kv_block_lru" when a KV block it needed was reused, at what age and of which kind);
- "salt_mismatch": the same tokens are cached under another `cache_salt` (never shared);
- "no_snapshot": more tokens match cached KV blocks than were reused, but no state snapshot lies
  between (`nearest_snapshot`: the position below the match it resumed from, 0 for none; a branch
  snapshot is taken there for the next request);
- "no_match": the rest of the prompt matches nothing cached.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvstate.engine.prefix_cache import MISS_REASONS

REASONS = ("caching_off", *MISS_REASONS)


@dataclass(frozen=True)
class CacheReport:
    prompt_tokens: int
    matched_tokens: int  # prompt tokens matching what is cached under the request's salt
    reused_tokens: int  # prompt tokens not computed (resumed from a snapshot)
    source: str | None = None  # kind of the snapshot resumed from (prefix_cache.KINDS), None: none
    source_position: int | None = None  # its position
    shared_blocks: int = 0  # full KV blocks shared with it
    reason: str | None = None  # why reuse stopped short (REASONS); None: it did not
    nearest_snapshot: int | None = None  # with "no_snapshot": where it resumed below the match (0: none)
    evicted: dict | None = None  # with "evicted": {"position", "kind", "policy", "age_s"}
    other_salt_tokens: int = 0  # with "salt_mismatch": tokens matching under another salt
    salted: bool = False  # whether the request had a cache_salt

    @classmethod
    def off(cls, prompt_tokens: int) -> "CacheReport":
        return cls(prompt_tokens, 0, 0, reason="caching_off")

    def to_dict(self) -> dict:
        return asdict(self)


def merge_reports(reports: list[CacheReport | None]) -> CacheReport | None:
    """One prompt's report from its n samples': the one that reused least (as `num_cached_tokens`)."""
    known = [r for r in reports if r is not None]
    return min(known, key=lambda r: r.reused_tokens) if known else None


def explain(cache, tokens: list[int], chain: list, root: bytes, snap, matched: int, *,
            needs_full_prompt: bool = False) -> CacheReport:
    """The report of a first admission that resumed from `snap` (or None) where `matched` prompt
    tokens match cached blocks (`cache`: the PrefixCache; `chain`: the key chain of `tokens` under `root`)."""
    p = snap.num_tokens if snap is not None else 0
    matched = max(matched, p)
    common = dict(prompt_tokens=len(tokens), matched_tokens=matched, reused_tokens=p,
                  source=snap.kind if snap is not None else None, source_position=p if snap is not None else None,
                  shared_blocks=len(snap.chain) if snap is not None else 0, salted=root != cache.default_root)
    if p >= len(tokens) - 1:
        return CacheReport(**common)
    if needs_full_prompt:
        return CacheReport(**common, reason="needs_full_prompt")
    ev = cache.evicted_below(tokens, chain, root, p)
    if ev is not None:
        return CacheReport(**common, reason="evicted", evicted={
            "position": ev.position, "kind": ev.kind, "policy": ev.policy, "age_s": round(ev.age, 6)})
    other = cache.best_other_salt(tokens, root)
    if other > matched:
        return CacheReport(**common, reason="salt_mismatch", other_salt_tokens=other)
    if matched > p:
        return CacheReport(**common, reason="no_snapshot", nearest_snapshot=p)
    return CacheReport(**common, reason="no_match")
