"""Dtype names as configs and users write them, reduced to one canonical name and a byte size.

Configs say "bfloat16", "torch.bfloat16" or "bf16"; users type "fp8" or "half". No torch here:
the canonical names are torch's, so `getattr(torch, name)` works wherever torch is loaded.
"""

from __future__ import annotations

# canonical name -> bytes per element
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float64": 8,
}

_ALIASES: dict[str, str] = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "float8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "fp64": "float64", "double": "float64",
}


def canonical_dtype(name: object) -> str | None:
    """The canonical dtype name for `name`, or None if it is not a dtype we know."""
    if not isinstance(name, str):
        return None
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    return key if key in DTYPE_BYTES else None


# canonical names of the weight dtypes the engine loads (`--weight-dtype`, load_model), and how to say so
# int8: per-row scales (kernels.quant); q8_0, q4_0, q4_k: GGML's blocks (kernels.blocks), as in a GGUF file
QUANTIZED_WEIGHT_DTYPES = ("int8", "q8_0", "q4_0", "q4_k")
WEIGHT_DTYPES = ("float32", "bfloat16") + QUANTIZED_WEIGHT_DTYPES
WEIGHT_DTYPES_EXPECTED = "expected bf16, fp32, int8, q8_0, q4_0 or q4_k (or bfloat16, float32)"


def canonical_weight_dtype(name: object) -> str | None:
    """A weight dtype: a quantized one ("int8", "q8_0", "q4_0", "q4_k", any case), or a float
    dtype's canonical name from any spelling `canonical_dtype` takes; None if unknown."""
    if isinstance(name, str):
        key = name.strip().lower().removeprefix("torch.")
        if key in QUANTIZED_WEIGHT_DTYPES:
            return key
    return canonical_dtype(name)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype given by any accepted spelling (ValueError if unknown)."""
    canonical = canonical_dtype(name)
    if canonical is None:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(known_dtypes())})")
    return DTYPE_BYTES[canonical]


def known_dtypes() -> list[str]:
    return list(DTYPE_BYTES)
