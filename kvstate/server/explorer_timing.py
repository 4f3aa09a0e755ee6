"""The explorer's cache on/off panel in time: the same steps run with the cache and without it.

The schedule is the engine's own for the request (the step recorder's records: the prompt, in
chunks when it is long, then one position per generated token). Both sides then run on the served
model in one worker thread, step by step and alternating, on the same tokens (prompt and the
tokens the engine generated), timed the same way:

- with the cache: each step computes only its new positions on preallocated pools (K/V and state
  carried from the step before), as the engine does;
- without it: each step is a full forward over the whole prefix so far (its own scratch buffers,
  allocated outside the timer), as a model with no cache must recompute it.

The engine's wall time of each step (scheduling and sampling included) is reported beside them.
"""

from __future__ import annotations

import time


def _forward(model, ids: list[int], context: int, caches, max_len: int):
    import torch

    from kvstate.models.batch import Batch

    batch = Batch.build([len(ids)], [context], [0], [[0]], max_len, device=model.device)
    return model(torch.tensor(ids, device=model.device), batch, caches)  # logits of the last position


def on_off_ms(model, tokens: list[int], steps: list[dict]) -> list[tuple[float, float]]:
    """(ms with the cache, ms without) for each engine step record {context, computed} over `tokens`."""
    import torch

    from kvstate.models.generate import contiguous_caches

    total = len(tokens)
    cached = contiguous_caches(model, 1, total)
    out = []
    with torch.inference_mode():
        for s in steps:
            ctx, n = s["context"], s["computed"]
            t = time.perf_counter()
            _forward(model, tokens[ctx:ctx + n], ctx, cached, total)
            on = time.perf_counter() - t
            scratch = contiguous_caches(model, 1, ctx + n)
            t = time.perf_counter()
            _forward(model, tokens[:ctx + n], 0, scratch, ctx + n)
            out.append((on * 1e3, (time.perf_counter() - t) * 1e3))
    return out
