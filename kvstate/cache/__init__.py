"""The engine's two kinds of cache, described and (later) allocated.

`spec` (torch-free): per-layer KV bytes per token and fixed per-request state, computed from a
ModelPlan. The pools that a later issue adds here (paged KV blocks + state slots) size
themselves from the same spec, so `kvstate memory` predicts exactly what the engine allocates.
"""

from kvstate.cache.spec import CONV_WINDOWS, CacheEntry, CacheSpec, TensorSpec, cache_spec, mixer_entry

__all__ = ["CONV_WINDOWS", "CacheEntry", "CacheSpec", "TensorSpec", "cache_spec", "mixer_entry"]
