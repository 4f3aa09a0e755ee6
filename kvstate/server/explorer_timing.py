"""The explorer's cache on/off panel in time: each engine step as it ran beside a forward without a cache.

With the cache, a request's steps are the engine's own (the step recorder's milliseconds: the
prompt once, then one position per token). Without it, a model recomputes the whole prefix at
every step: here one full forward of the served model over the same tokens (prompt and the tokens
generated so far), timed on its own, once per engine step. Both run the same weights on the same
tokens, so the difference is the positions recomputed.
"""

from __future__ import annotations

import time


def no_cache_ms(model, tokens: list[int], steps: list[dict]) -> list[float]:
    """Milliseconds of a full forward over tokens[:context + computed] for each engine step's record."""
    from kvstate.models.generate import forward_logits

    out = []
    for s in steps:
        prefix = tokens[: s["context"] + s["computed"]]
        t = time.perf_counter()
        forward_logits(model, [prefix])
        out.append((time.perf_counter() - t) * 1e3)
    return out
