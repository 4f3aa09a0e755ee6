"""What prefix caching costs a first request: time to first token with caching off and on.

A new prompt (token ids, seeded; never seen by either engine) with `points` cache_prefix
positions spread over it runs alone through an engine with caching off and one with the default
policy (plus the repeat's and the interval's own snapshot points), the two in alternating order
round by round (off, on; then on, off; ...) so a load that drifts on a shared machine weighs on
both. The snapshot points cost the first request only the state copies at those positions: its
prefill runs the same chunks either way (`kvstate.ops.states_at`). Reported: each side's median
time to first token and their ratio (the issue's target: <= 1.05 at 1,024 tokens, 4 points).
"""

from __future__ import annotations

import random
import statistics

from kvstate.bench import prefix_serving as serving

SHAPES = {"full": dict(prompt=1024, points=4, rounds=3), "quick": dict(prompt=120, points=4, rounds=2)}


def points(length: int, n: int) -> dict[int, str]:
    """`n` cache_prefix positions spread evenly inside a prompt of `length` tokens (not at its end)."""
    return {length * (i + 1) // (n + 1): "prefix" for i in range(n)}


def run(model, plan, shape: dict, serving_shape: dict, seed: int) -> dict:
    """{"prompt", "points", "rounds", "ttft_off_ms", "ttft_on_ms" (per round), medians, "ratio"}."""
    from kvstate.errors import KvstateError

    rng = random.Random(f"first-{seed}")
    cores = {p: serving.make_core(model, plan, p, serving_shape) for p in ("off", "kvstate")}
    hints = points(shape["prompt"], shape["points"])
    times: dict[str, list[float]] = {"off": [], "kvstate": []}
    for r in range(shape["rounds"]):
        ids = [rng.randrange(10, plan.vocab_size) for _ in range(shape["prompt"])]
        replies = set()
        for policy in (("off", "kvstate") if r % 2 == 0 else ("kvstate", "off")):
            out = serving.serve(cores[policy], list(ids), dict(hints) if policy != "off" else None, 1)
            if policy != "off" and (out.num_cached_tokens or 0) != 0:
                raise KvstateError("bench prefix: a first request found something cached")
            times[policy].append(out.metrics["time_to_first_token"])
            replies.add(tuple(out.token_ids))
        if len(replies) != 1:
            raise KvstateError("bench prefix: the first request's replies differ with caching on and off")
    off, on = statistics.median(times["off"]), statistics.median(times["kvstate"])
    held = cores["kvstate"].stats().get("snapshots_taken", 0)
    return {"prompt": shape["prompt"], "points": sorted(hints), "rounds": shape["rounds"],
            "ttft_off_ms": [1000 * t for t in times["off"]], "ttft_on_ms": [1000 * t for t in times["kvstate"]],
            "median_off_ms": 1000 * off, "median_on_ms": 1000 * on, "ratio": on / off,
            "snapshots_taken": held}
