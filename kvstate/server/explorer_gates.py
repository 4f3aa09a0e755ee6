"""The explorer's "append against update in place" panel: how long the served model's linear layers remember.

For a prompt, one forward of the served model with a pre-hook on every linear mixer that offers
`log_decay(x)` (Gated DeltaNet and Mamba-2: g [T, H]; KDA: g [T, H, D] per key channel) keeps the
mixer's input; the layer's own gate computation then gives g, the log of the factor by which the
state decays at each token. A head's memory horizon is the number of tokens after which a write
holds less than `THRESHOLD` of its weight, at the head's mean log decay over the prompt (the
geometric mean of its per-token decays): the smallest n with exp(mean g)^n < THRESHOLD. That is
also the number of the latest tokens (the newest included) that still hold >= THRESHOLD, the
document's readout for its scalar cartoon (decay 0.85 -> 15 tokens). KDA heads are summarized by
the mean of g over the head's channels too, with the fastest and slowest channel's horizons beside.

Then the prompt runs again one token at a time with the cache (contiguous pools, as
`models.generate`): after each token, the KV cells the attention layers hold (one per token) and one
linear layer's state slot, updated in place: each head's norm and a small |S| map of one head.
"""

from __future__ import annotations

import math

THRESHOLD = 0.1
NEVER = 10**9  # horizons past this many tokens are reported as None ("never", within reason)
MAP_SIDE = 16  # the state map is average-pooled down to at most MAP_SIDE x MAP_SIDE


def horizon(log_decay: float, threshold: float = THRESHOLD) -> int | None:
    """Tokens until a write's weight exp(log_decay)^n falls below `threshold` (None: past NEVER)."""
    if not log_decay < 0:
        return None
    n = math.floor(math.log(threshold) / log_decay) + 1
    return n if n <= NEVER else None


def cartoon_table(lo: float = 0.5, hi: float = 0.95, step: float = 0.01) -> list[dict]:
    """The slider's stops: decay -> tokens that keep >= THRESHOLD of the weight (the same formula)."""
    stops = round((hi - lo) / step)
    return [{"decay": round(lo + i * step, 2), "tokens": horizon(math.log(round(lo + i * step, 2)))}
            for i in range(stops + 1)]


def mixer_inputs(model, ids: list[int]) -> dict[int, "object"]:
    """{layer index: the input [T, hidden] its linear mixer saw} over one forward of `ids`."""
    from kvstate.models.generate import forward_logits

    seen, handles = {}, []
    for i, block in enumerate(model.layers):
        if block.mixer is not None and hasattr(block.mixer, "log_decay"):
            handles.append(block.mixer.register_forward_pre_hook(
                lambda mod, args, i=i: seen.__setitem__(i, args[0].detach().clone())))
    try:
        forward_logits(model, [ids])
    finally:
        for h in handles:
            h.remove()
    return seen


def head_rows(g) -> list[dict]:
    """One row per head of a layer's g: [T, H] or [T, H, D] (per channel)."""
    rows = []
    per_channel = g.dim() == 3
    for h in range(g.shape[1]):
        gh = g[:, h]  # [T] or [T, D]
        mean = float(gh.mean())
        row = {"head": h, "mean_log_decay": mean, "decay": math.exp(mean), "horizon": horizon(mean),
               "per_token": [math.exp(float(v)) for v in (gh.mean(-1) if per_channel else gh)]}
        if per_channel:
            by_channel = gh.mean(0)  # [D]
            row["fastest_channel_horizon"] = horizon(float(by_channel.min()))
            row["slowest_channel_horizon"] = horizon(float(by_channel.max()))
        rows.append(row)
    return rows


def decays(model, ids: list[int]) -> list[dict]:
    """Per linear layer with a gate: its kind, g's layout, and each head's decays and horizon."""
    import torch

    with torch.inference_mode():
        inputs = mixer_inputs(model, ids)
        out = []
        for i, x in sorted(inputs.items()):
            g = model.layers[i].mixer.log_decay(x).float()  # [T, H] or [T, H, D]
            out.append({"layer": i, "kind": type(model.layers[i].mixer).__name__,
                        "per_channel": g.dim() == 3, "heads": head_rows(g)})
    return out


def _pooled(m, side: int = MAP_SIDE) -> list[list[float]]:
    """|m| [R, C] average-pooled to at most side x side."""
    import torch.nn.functional as F

    r, c = m.shape
    pooled = F.adaptive_avg_pool2d(m.abs()[None, None], (min(r, side), min(c, side)))[0, 0]
    return [[round(float(v), 5) for v in row] for row in pooled]


def walk(model, ids: list[int], layer: int) -> list[dict]:
    """Token by token with the cache: per token, the KV cells held and `layer`'s state slot after it."""
    import torch

    from kvstate.models.batch import Batch
    from kvstate.models.generate import contiguous_caches

    n = len(ids)
    caches = contiguous_caches(model, 1, n)
    attention = [i for i, c in enumerate(caches) if c.k is not None or c.latent is not None]
    steps = []
    with torch.inference_mode():
        for t in range(n):
            batch = Batch.build([1], [t], [0], [[0]], n, device=model.device)
            model(torch.tensor(ids[t:t + 1], device=model.device), batch, caches)
            state = caches[layer].state[0].float()  # [H, a, b] (one slot), or [a, b] (Mamba-1)
            heads = state if state.dim() == 3 else state[None]
            steps.append({"token": t, "kv_cells": (t + 1) * len(attention),
                          "head_norms": [float(h.norm()) for h in heads], "map": _pooled(heads[0])})
    return steps


def state_shape(model, layer: int) -> list[int]:
    from kvstate.cache.spec import cache_spec

    for e in cache_spec(model.plan).entries:
        if e.layer == layer and "state" in e.pool_shapes(1):
            return list(e.pool_shapes(1)["state"])
    return []
