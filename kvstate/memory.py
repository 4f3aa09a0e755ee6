"""The memory planner's arithmetic: cache bytes per request, GPU fits, sizes and token counts.

Everything is exact integer bytes from the cache spec (kvstate.cache.spec); rounding happens
only when printing. Units: 1 KiB = 1024 B. Token counts "8k", "128K", "1m" are binary
(8k = 8192, 1m = 1048576 tokens), as the spec documents' 8K/128K/256K mean 8192/131072/262144.
Sizes: "80GiB" and bare "80G" are binary (80 x 2^30), "80GB" decimal (80 x 10^9). No torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvstate.cache.spec import CacheSpec
from kvstate.config.dtypes import dtype_bytes
from kvstate.config.plan import ModelPlan
from kvstate.errors import KvstateError

DEFAULT_CONTEXTS: tuple[int, ...] = (8192, 131072, 262144)
KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

_TOKEN_UNITS = {"": 1, "k": KIB, "m": MIB}
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KIB, "kib": KIB, "m": MIB, "mib": MIB, "g": GIB, "gib": GIB, "t": TIB, "tib": TIB,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}


def parse_tokens(text: str, option: str = "--context") -> int:
    """"32k" -> 32768, "1m" -> 1048576, "4096" -> 4096 (positive whole tokens)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
    if not m:
        raise KvstateError(f"{option}: cannot read {text!r} as a token count (examples: 4096, 32k, 1m)")
    value = float(m.group(1)) * _TOKEN_UNITS[m.group(2).lower()]
    if value <= 0 or not value.is_integer():
        raise KvstateError(f"{option}: {text!r} must be a positive whole number of tokens")
    return int(value)


def parse_contexts(text: str, option: str = "--context") -> tuple[int, ...]:
    """A comma-separated list of token counts, e.g. "8k,128k,256k"."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise KvstateError(f"{option}: give at least one context length, e.g. 8k,128k")
    return tuple(parse_tokens(p, option) for p in parts)


def parse_size(text: str, option: str = "--gpu-memory") -> int:
    """"80GiB" / "80G" -> 80 x 2^30, "80GB" -> 80 x 10^9, "1536MiB", "0.5T" (bytes, positive)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and _SIZE_UNITS.get(m.group(2).lower())
    if not m or unit is None:
        raise KvstateError(f"{option}: cannot read {text!r} as a size (examples: 80GiB, 80GB, 24G, 1536MiB)")
    value = int(float(m.group(1)) * unit)
    if value <= 0:
        raise KvstateError(f"{option}: {text!r} must be positive")
    return value


def format_bytes(n: int | float) -> str:
    """Human bytes in KiB / MiB / GiB: whole values without decimals, else 2 decimals below 10
    and 1 above ("128 KiB", "7.88 KiB", "61.9 MiB", "2.56 GiB")."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(n) >= size:
            value = n / size
            break
    else:
        return f"{int(n)} B"
    if value == int(value):
        return f"{int(value)} {unit}"
    return f"{value:.2f} {unit}" if abs(value) < 10 else f"{value:.1f} {unit}"


def format_tokens(n: int) -> str:
    """8192 -> "8K", 131072 -> "128K", 1048576 -> "1M", 5000 -> "5000"."""
    for unit, size in (("M", MIB), ("K", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def summary(plan: ModelPlan, spec: CacheSpec, contexts: tuple[int, ...] = DEFAULT_CONTEXTS,
            batch: int = 1) -> dict:
    """The JSON object of one model: exact bytes per request (batch 1) and for `batch` requests."""
    return {
        "model": plan.name,
        "model_type": plan.model_type,
        "layers": plan.mixer_counts,
        "layer_string": plan.layer_string,
        "kv_dtype": spec.kv_dtype,
        "state_dtype": spec.state_dtype,
        "conv_dtype": spec.conv_dtype,
        "conv_window": spec.conv_window,
        "kv_bytes_per_token": spec.kv_bytes_per_token,
        "recurrent_state_bytes": spec.recurrent_state_bytes,
        "conv_state_bytes": spec.conv_state_bytes,
        "state_bytes": spec.state_bytes,
        "totals": {str(c): spec.request_bytes(c) for c in contexts},
        "batch": batch,
        "batch_totals": {str(c): batch * spec.request_bytes(c) for c in contexts},
        "max_position_embeddings": plan.max_position_embeddings,
        "parameters": plan.params.total,
    }


def snapshot_bytes(spec: CacheSpec, count: int, block_size: int = 16) -> dict:
    """What `count` prefix-cache snapshots cost (kvstate.engine.prefix_cache): each holds one state
    slot (every linear layer's recurrent state and conv window), and at most one partial KV block
    of `block_size` tokens (the one its position falls in; none at a block boundary), which comes
    out of the KV pool."""
    state, block = count * spec.state_bytes, count * block_size * spec.kv_bytes_per_token
    return {"count": count, "block_size": block_size, "state_bytes": state, "partial_kv_bytes_max": block,
            "total_bytes_max": state + block}


def snapshots_within(spec: CacheSpec, budget: int) -> int:
    """How many snapshots' state slots fit in `budget` bytes (`--snapshot-memory`)."""
    return budget // spec.state_bytes if spec.state_bytes else 0


def checkpoint_weight_bytes(directory: str | Path) -> int | None:
    """Total size of the *.safetensors files in a checkpoint directory (None if there are none)."""
    files = sorted(Path(directory).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files) if files else None


@dataclass(frozen=True)
class Fit:
    """How many requests fit on a GPU after the weights, and the longest single context."""

    gpu_bytes: int
    weight_bytes: int
    weight_source: str  # "parameters" (count x dtype size), "safetensors" (file sizes) or "gguf" (its tensors)
    free_bytes: int  # gpu - weights (negative: the weights alone do not fit)
    max_requests: dict[int, int]  # context -> whole requests that fit
    max_context: int | None  # longest context of one request; None: unbounded (no KV, no model limit)
    limited_by_model: bool  # max_context was capped at max_position_embeddings

    def as_json(self) -> dict:
        return {"gpu_bytes": self.gpu_bytes, "weight_bytes": self.weight_bytes,
                "weight_source": self.weight_source, "free_bytes": self.free_bytes,
                "max_requests": {str(c): n for c, n in self.max_requests.items()},
                "max_context": self.max_context, "max_context_limited_by_model": self.limited_by_model}


def fit(plan: ModelPlan, spec: CacheSpec, gpu_bytes: int, contexts: tuple[int, ...],
        checkpoint_dir: str | Path | None = None) -> Fit:
    """Requests that fit in `gpu_bytes` after the weights (safetensors size for a checkpoint
    directory, a GGUF file's tensor bytes (quantized as it holds them), else parameter estimate x
    model dtype size), at each context length."""
    on_disk = checkpoint_weight_bytes(checkpoint_dir) if checkpoint_dir else None
    if on_disk is not None:
        weights, source = on_disk, "safetensors"
    elif plan.config.get("gguf_tensor_bytes"):
        weights, source = int(plan.config["gguf_tensor_bytes"]), "gguf"
    else:
        weights, source = plan.params.total * dtype_bytes(plan.dtype), "parameters"
    free = gpu_bytes - weights
    room = max(free, 0)
    requests = {c: room // spec.request_bytes(c) if spec.request_bytes(c) else 0 for c in contexts}
    limit = plan.max_position_embeddings
    if spec.kv_bytes_per_token == 0:  # constant cache: context bounded only by the model
        longest = limit if room >= spec.state_bytes else 0
        capped = limit is not None and room >= spec.state_bytes
    else:
        longest = max(room - spec.state_bytes, 0) // spec.kv_bytes_per_token
        capped = limit is not None and longest > limit
        longest = min(longest, limit) if capped else longest
    return Fit(gpu_bytes, weights, source, free, requests, longest, capped)


def crossover_tokens(spec: CacheSpec) -> float | None:
    """Context where the KV cache equals the fixed state (None if either is zero)."""
    if not spec.kv_bytes_per_token or not spec.state_bytes:
        return None
    return spec.state_bytes / spec.kv_bytes_per_token
