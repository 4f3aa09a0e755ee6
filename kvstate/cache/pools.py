"""The cache pools: paged KV blocks for attention layers, state slots for linear layers.

Allocated once. Per layer the pool holds, as its mixers declare in `cache_shapes`:
- per KV block: "k", "v" ([block_size, Hkv, D]) or "latent" (MLA) in the KV dtype;
- per state slot: "state" (recurrent, fp32 by default) and "conv" (the short-conv window, in the
  model dtype).
A block or slot id indexes dim 0 of every layer's tensors, so a sequence owns the same block
and slot ids in all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

BLOCK_KEYS = ("k", "v", "latent")
SLOT_KEYS = ("state", "conv")


@dataclass
class LayerCache:
    k: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, Dv]
    latent: torch.Tensor | None = None  # [num_blocks, block_size, R] (MLA)
    state: torch.Tensor | None = None  # [num_slots, *state_shape]
    conv: torch.Tensor | None = None  # [num_slots, conv_dim, W]

    def nbytes(self, keys=BLOCK_KEYS + SLOT_KEYS) -> int:
        return sum(t.numel() * t.element_size() for f in fields(self)
                   if f.name in keys and (t := getattr(self, f.name)) is not None)


def layer_cache_shapes(model, block_size: int) -> list[dict[str, tuple[int, ...]]]:
    """Per layer: {key: shape of one block or one slot}, merged over the block's mixers."""
    out = []
    for block in model.layers:
        shapes: dict[str, tuple[int, ...]] = {}
        if block.mixer is not None and hasattr(block.mixer, "cache_shapes"):
            shapes.update(block.mixer.cache_shapes(block_size))
        out.append(shapes)
    return out


def allocate(model, *, num_blocks: int, block_size: int, num_slots: int, kv_dtype=torch.float32,
             state_dtype=torch.float32, conv_dtype=torch.float32) -> list[LayerCache]:
    """Zero-filled pools for every layer of `model`."""
    dtypes = {"k": kv_dtype, "v": kv_dtype, "latent": kv_dtype, "state": state_dtype, "conv": conv_dtype}
    caches = []
    for shapes in layer_cache_shapes(model, block_size):
        parts = {}
        for key, shape in shapes.items():
            count = num_blocks if key in BLOCK_KEYS else num_slots
            parts[key] = torch.zeros((count, *shape), dtype=dtypes[key])
        caches.append(LayerCache(**parts))
    return caches


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def allocate_from_spec(spec, num_layers: int, *, num_blocks: int, block_size: int, num_slots: int) -> list[LayerCache]:
    """Zero-filled pools exactly as the memory planner's cache spec (kvstate.cache.spec) describes them.

    Per attention entry: k and v [num_blocks, block_size, Hkv, D] (the spec's per-token [2, Hkv, D]);
    per MLA entry: latent [num_blocks, block_size, R]; per linear entry: state [num_slots, *recurrent]
    and conv [num_slots, *conv]. So the pools hold num_blocks * block_size * kv_bytes_per_token +
    num_slots * state_bytes, the planner's arithmetic."""
    caches = [LayerCache() for _ in range(num_layers)]
    for e in spec.entries:
        c = caches[e.layer]
        if e.kv is not None:
            dtype = _TORCH_DTYPES[e.kv.dtype]
            if e.kind == "attention":  # per token [2, Hkv, D]
                shape = (num_blocks, block_size, *e.kv.shape[1:])
                c.k, c.v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            else:  # MLA: one latent per token
                c.latent = torch.zeros((num_blocks, block_size, *e.kv.shape), dtype=dtype)
        if e.recurrent is not None:
            c.state = torch.zeros((num_slots, *e.recurrent.shape), dtype=_TORCH_DTYPES[e.recurrent.dtype])
        if e.conv is not None:
            c.conv = torch.zeros((num_slots, *e.conv.shape), dtype=_TORCH_DTYPES[e.conv.dtype])
    return caches


def check_against_model(caches: list[LayerCache], model, block_size: int) -> None:
    """Raise ValueError if a layer's pools do not have the shapes its mixer declares."""
    for i, (cache, shapes) in enumerate(zip(caches, layer_cache_shapes(model, block_size))):
        for key, shape in shapes.items():
            t = getattr(cache, key)
            if t is None or tuple(t.shape[1:]) != tuple(shape):
                got = None if t is None else tuple(t.shape[1:])
                raise ValueError(f"layer {i}: pool {key!r} has per-entry shape {got}, the model needs {tuple(shape)}")
