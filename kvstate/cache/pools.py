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
