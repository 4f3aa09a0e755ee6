"""The per-layer cache spec: exactly what the engine allocates for one request (no torch).

`cache_spec(plan, kv_dtype=, state_dtype=, conv_dtype=, conv_window=)` turns a ModelPlan into
one `CacheEntry` per token mixer, as each mixer kind describes its cache (kvstate.config.mixers):

    attention   kv     per token [2, num_kv_heads, head_dim]       (K and V)
    mla         kv     per token [kv_lora_rank + qk_rope_head_dim]  (one latent, no separate V)
    gated_deltanet recurrent [num_v_heads, head_k_dim, head_v_dim]  conv [conv_dim, window]
    kda         recurrent [num_heads, head_dim, head_dim]           conv [3 * num_heads * head_dim, window]
    mamba2      recurrent [num_heads, d_state, head_dim]            conv [d_inner + 2 * n_groups * d_state, window]
    mamba1      recurrent [d_inner, d_state]                        conv [d_inner, window]
    short_conv  conv [dim, window]

Recurrent states follow the ops' [H, K, V] orientation (DESIGN.md). `window` is the conv kernel
("kernel": what transformers allocates, and the spec documents' convention) or kernel - 1
("kernel-1": the columns a decode step really needs, as vLLM keeps). The pools
(`kvstate.cache.pools`) are allocated from these entries and nothing else, so the bytes here are
the bytes the engine allocates.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from kvstate.config.dtypes import canonical_dtype, dtype_bytes, known_dtypes
from kvstate.config.plan import MixerSpec, ModelPlan
from kvstate.errors import KvstateError

CONV_WINDOWS = ("kernel", "kernel-1")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor's shape (without the request/token dimension) and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """The cache of one mixer in one layer: KV per token and/or fixed state per request."""

    layer: int
    kind: str  # the mixer kind, e.g. "attention", "gated_deltanet"
    kv: TensorSpec | None = None  # per token
    recurrent: TensorSpec | None = None  # per request
    conv: TensorSpec | None = None  # per request

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv.nbytes if self.kv else 0

    @property
    def recurrent_bytes(self) -> int:
        return self.recurrent.nbytes if self.recurrent else 0

    @property
    def conv_bytes(self) -> int:
        return self.conv.nbytes if self.conv else 0

    @property
    def state_bytes(self) -> int:
        return self.recurrent_bytes + self.conv_bytes

    def to_json(self) -> dict:
        """This entry as `kvstate memory --json --layers` and the explorer write it."""
        def t(spec: TensorSpec | None) -> dict | None:
            return None if spec is None else {"shape": list(spec.shape), "dtype": spec.dtype, "bytes": spec.nbytes}
        return {"layer": self.layer, "kind": self.kind, "kv_per_token": t(self.kv), "recurrent": t(self.recurrent),
                "conv": t(self.conv)}

    def pool_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        """The shape of one pool entry per key: "k"/"v" [block_size, Hkv, D] or "latent" [block_size, R]
        per KV block; "state" (recurrent) and "conv" [conv_dim, window] per state slot."""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.kv is not None:
            if self.kind == "attention":  # per token [2, Hkv, D]: K and V pools
                shapes["k"] = shapes["v"] = (block_size, *self.kv.shape[1:])
            else:  # MLA: one latent per token
                shapes["latent"] = (block_size, *self.kv.shape)
        if self.recurrent is not None:
            shapes["state"] = self.recurrent.shape
        if self.conv is not None:
            shapes["conv"] = self.conv.shape
        return shapes


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """All cache entries of a model for the chosen dtypes and conv window."""

    model: str
    kv_dtype: str
    state_dtype: str
    conv_dtype: str
    conv_window: str  # "kernel" | "kernel-1"
    entries: tuple[CacheEntry, ...]
    num_layers: int = 0  # decoder blocks, with or without an entry

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(e.kv_bytes_per_token for e in self.entries)

    @property
    def recurrent_state_bytes(self) -> int:
        return sum(e.recurrent_bytes for e in self.entries)

    @property
    def conv_state_bytes(self) -> int:
        return sum(e.conv_bytes for e in self.entries)

    @property
    def state_bytes(self) -> int:
        """Fixed bytes per request, whatever the context length (recurrent + conv)."""
        return self.recurrent_state_bytes + self.conv_state_bytes

    def request_bytes(self, context: int) -> int:
        """Cache bytes of one request holding `context` tokens."""
        return self.kv_bytes_per_token * context + self.state_bytes


# What kvstate's own engine (kvstate.engine.core: generate, serve, bench) allocates its pools in on
# CPU, whatever the checkpoint's dtype: fp32 math reads them without a conversion. `kvstate memory`
# plans in the model's dtype by default, so it says so beside a bf16 checkpoint's figures.
ENGINE_POOL_DTYPES = {"kv": "float32", "state": "float32", "conv": "float32"}


def _dtype(name: str, option: str) -> str:
    canonical = canonical_dtype(name)
    if canonical is None:
        raise KvstateError(f"{option}: unknown dtype {name!r} (known: {', '.join(known_dtypes())})")
    return canonical


def mixer_entry(layer: int, m: MixerSpec, kv_dtype: str, state_dtype: str, conv_dtype: str,
                conv_window: str) -> CacheEntry:
    """The cache of one mixer as its spec kind describes it (dtypes canonical, conv_window one of CONV_WINDOWS)."""
    kv, state, conv = m.kv_shape(), m.state_shape(), m.conv_shape(conv_window)
    return CacheEntry(layer, m.kind, kv=kv and TensorSpec(kv, kv_dtype),
                      recurrent=state and TensorSpec(state, state_dtype), conv=conv and TensorSpec(conv, conv_dtype))


def cache_spec(plan: ModelPlan, *, kv_dtype: str | None = None, state_dtype: str | None = None,
               conv_dtype: str | None = None, conv_window: str = "kernel", mtp: bool = False) -> CacheSpec:
    """The cache of one request of `plan`. Dtypes default to the plan's: model dtype for KV and
    conv, `plan.state_dtype` for recurrent states. Unknown dtypes or windows raise KvstateError.
    `mtp`: with the KV of the plan's multi-token-prediction blocks (layers after the decoder's),
    which an engine drafting with them keeps in the same blocks as the target's KV."""
    if conv_window not in CONV_WINDOWS:
        raise KvstateError(f"--conv-window: expected one of {', '.join(CONV_WINDOWS)}, got {conv_window!r}")
    kv = _dtype(kv_dtype or plan.dtype, "--kv-dtype")
    state = _dtype(state_dtype or plan.state_dtype, "--state-dtype")
    conv = _dtype(conv_dtype or plan.dtype, "--conv-dtype")
    layers = plan.layers + (plan.mtp if mtp else ())
    entries = tuple(mixer_entry(layer.index, m, kv, state, conv, conv_window) for layer in layers for m in layer.mixers)
    return CacheSpec(plan.name, kv, state, conv, conv_window, entries, len(layers))
