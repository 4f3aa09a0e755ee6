"""The engine's two kinds of cache: described (`spec`, torch-free) and allocated (`pools`).

`spec`: per-layer KV bytes per token and fixed per-request state, computed from a ModelPlan's
mixer kinds. `pools` (paged KV blocks + state slots, torch) are allocated from that spec alone,
so `kvstate memory` predicts exactly what the engine allocates. Import `kvstate.cache.pools`
explicitly: this package stays importable without torch.
"""

from kvstate.cache.spec import CONV_WINDOWS, CacheEntry, CacheSpec, TensorSpec, cache_spec, mixer_entry

__all__ = ["CONV_WINDOWS", "CacheEntry", "CacheSpec", "TensorSpec", "cache_spec", "mixer_entry"]
