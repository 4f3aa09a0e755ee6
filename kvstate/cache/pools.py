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


def _zeros(layer_shapes, dtypes: dict[str, torch.dtype], num_blocks: int, num_slots: int,
           device) -> list[LayerCache]:
    """Per layer, a zero-filled pool of num_blocks (KV keys) or num_slots (state keys) entries per key."""
    return [LayerCache(**{key: torch.zeros((num_blocks if key in BLOCK_KEYS else num_slots, *shape),
                                           dtype=dtypes[key], device=device)
                          for key, shape in shapes.items()})
            for shapes in layer_shapes]


def allocate(model, *, num_blocks: int, block_size: int, num_slots: int, kv_dtype=torch.float32,
             state_dtype=torch.float32, conv_dtype=torch.float32, device=None) -> list[LayerCache]:
    """Zero-filled pools for every layer of `model`."""
    dtypes = {"k": kv_dtype, "v": kv_dtype, "latent": kv_dtype, "state": state_dtype, "conv": conv_dtype}
    return _zeros(layer_cache_shapes(model, block_size), dtypes, num_blocks, num_slots, device)


_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def spec_layer_shapes(spec, num_layers: int, block_size: int) -> list[dict[str, tuple[int, ...]]]:
    """Per layer: {key: shape of one block or one slot}, as the memory planner's cache spec
    (kvstate.cache.spec) describes them, in the form of `layer_cache_shapes`.

    Per attention entry: k and v (block_size, Hkv, D) (the spec's per-token [2, Hkv, D]); per MLA
    entry: latent (block_size, R); per linear entry: state (the recurrent shape) and conv. A layer
    without an entry has {}."""
    out: list[dict[str, tuple[int, ...]]] = [{} for _ in range(num_layers)]
    for e in spec.entries:
        shapes = {}
        if e.kv is not None:
            if e.kind == "attention":  # per token [2, Hkv, D]
                shapes["k"] = shapes["v"] = (block_size, *e.kv.shape[1:])
            else:  # MLA: one latent per token
                shapes["latent"] = (block_size, *e.kv.shape)
        if e.recurrent is not None:
            shapes["state"] = tuple(e.recurrent.shape)
        if e.conv is not None:
            shapes["conv"] = tuple(e.conv.shape)
        if shapes.keys() & out[e.layer].keys():
            raise ValueError(f"layer {e.layer}: two cache entries hold {sorted(shapes.keys() & out[e.layer].keys())}")
        out[e.layer].update(shapes)
    return out


def allocate_from_spec(spec, num_layers: int, *, num_blocks: int, block_size: int, num_slots: int,
                       device=None) -> list[LayerCache]:
    """Zero-filled pools exactly as the memory planner's cache spec describes them (`spec_layer_shapes`),
    KV pools in the spec's kv dtype, state and conv in its state and conv dtypes. So the pools hold
    num_blocks * block_size * kv_bytes_per_token + num_slots * state_bytes, the planner's arithmetic."""
    kv = _TORCH_DTYPES[spec.kv_dtype]
    dtypes = {"k": kv, "v": kv, "latent": kv, "state": _TORCH_DTYPES[spec.state_dtype],
              "conv": _TORCH_DTYPES[spec.conv_dtype]}
    return _zeros(spec_layer_shapes(spec, num_layers, block_size), dtypes, num_blocks, num_slots, device)


def check_against_model(caches: list[LayerCache], model, block_size: int) -> None:
    """Raise ValueError unless every layer has exactly the pools its mixer declares, of the shapes it
    declares: a missing pool, a pool of another shape and a pool the model does not declare all fail."""
    needs = layer_cache_shapes(model, block_size)
    if len(caches) != len(needs):
        raise ValueError(f"{len(caches)} layers of pools for a model of {len(needs)} layers")
    for i, (cache, shapes) in enumerate(zip(caches, needs)):
        have = {f.name: tuple(t.shape[1:]) for f in fields(cache) if (t := getattr(cache, f.name)) is not None}
        for key in sorted(have.keys() | shapes.keys()):
            need = tuple(shapes[key]) if key in shapes else None
            if have.get(key) != need:
                raise ValueError(f"layer {i}: pool {key!r} has per-entry shape {have.get(key)}, "
                                 + (f"the model needs {need}" if need else "the model declares no such pool"))
