"""The speculative decoding config, read from vLLM's dict (no torch).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    {"model": "path/to/draft", "num_speculative_tokens": 4}
    {"method": "mtp", "num_speculative_tokens": 2}     (the checkpoint's own MTP head; alias "qwen3_next_mtp")

Anything else is one clear error (KvstateError), not a traceback.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from kvstate.errors import KvstateError

KNOWN = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "mtp"
    num_speculative_tokens: int
    model: str | None = None  # the draft checkpoint (method "draft_model")
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1

    @classmethod
    def from_dict(cls, d) -> "SpeculativeConfig":
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise KvstateError(f"speculative_config must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - KNOWN)
        if unknown:
            raise KvstateError(f"speculative_config: unknown keys {unknown} (known: {sorted(KNOWN)})")
        model = d.get("model")
        method = d.get("method", "draft_model" if model is not None else None)
        if method in ("draft_model", "draft") and model is None:
            raise KvstateError("speculative_config: a draft model needs 'model': PATH")
        if method == "draft":
            method = "draft_model"
        if method in ("mtp", "qwen3_next_mtp"):
            method, model = "mtp", None  # the target's own head (vLLM may name the target as 'model')
        if method not in ("ngram", "draft_model", "mtp"):
            raise KvstateError(f"speculative_config: method must be 'ngram', 'mtp' or a draft 'model', got {method!r}")
        k = _int(d, "num_speculative_tokens", None)
        lo, hi = _int(d, "prompt_lookup_min", 1), _int(d, "prompt_lookup_max", 4)
        if k < 1:
            raise KvstateError(f"speculative_config: num_speculative_tokens must be >= 1, got {k}")
        if method == "ngram" and not 1 <= lo <= hi:
            raise KvstateError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        return cls(method, k, str(model) if model is not None else None, hi, lo)


def _int(d: dict, key: str, default: int | None) -> int:
    v = d.get(key, default)
    if v is None:
        raise KvstateError(f"speculative_config: '{key}' is required")
    try:
        if isinstance(v, bool):
            raise TypeError
        return operator.index(v)
    except TypeError:
        raise KvstateError(f"speculative_config: '{key}' must be an integer, got {v!r}") from None
