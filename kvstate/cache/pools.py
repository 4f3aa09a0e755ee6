"""The cache pools: paged KV blocks for attention layers, state slots for linear layers.

Allocated once, from the cache spec and nothing else (`kvstate.cache.spec`: each entry's
`pool_shapes`), so the bytes they hold are the memory planner's arithmetic. Per layer:
- per KV block: "k", "v" ([block_size, Hkv, D]) or "latent" (MLA) in the KV dtype;
- per state slot: "state" (recurrent, fp32 by default) and "conv" (the short-conv window of
  kernel or kernel - 1 columns, in the conv dtype).
A block or slot id indexes dim 0 of every layer's tensors, so a sequence owns the same block
and slot ids in all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kvstate.kernels import hugepages

BLOCK_KEYS = ("k", "v", "latent")
SLOT_KEYS = ("state", "conv")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                 "float64": torch.float64, "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


@dataclass
class LayerCache:
    k: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor | None = None  # [num_blocks, block_size, Hkv, Dv]
    latent: torch.Tensor | None = None  # [num_blocks, block_size, R] (MLA)
    state: torch.Tensor | None = None  # [num_slots, *state_shape]
    conv: torch.Tensor | None = None  # [num_slots, conv_dim, W or W-1]

    def nbytes(self, keys=BLOCK_KEYS + SLOT_KEYS) -> int:
        return sum(t.numel() * t.element_size() for f in fields(self)
                   if f.name in keys and (t := getattr(self, f.name)) is not None)


def layer_shapes(spec, block_size: int) -> list[dict[str, tuple[int, ...]]]:
    """Per layer: {key: shape of one block or one slot}, from the spec's entries ({} for a layer
    without a cache). Two entries of one layer may not claim the same key."""
    out: list[dict[str, tuple[int, ...]]] = [{} for _ in range(spec.num_layers)]
    for e in spec.entries:
        shapes = e.pool_shapes(block_size)
        if shapes.keys() & out[e.layer].keys():
            raise ValueError(f"layer {e.layer}: two cache entries hold {sorted(shapes.keys() & out[e.layer].keys())}")
        out[e.layer].update(shapes)
    return out


def allocate_pools(spec, *, num_blocks: int, block_size: int, num_slots: int, device=None) -> list[LayerCache]:
    """Zero-filled pools of every layer exactly as the cache spec describes them: KV keys in the spec's
    kv dtype (num_blocks entries), state and conv in its state and conv dtypes (num_slots entries).
    They hold num_blocks * block_size * kv_bytes_per_token + num_slots * state_bytes."""
    kv = _TORCH_DTYPES[spec.kv_dtype]
    dtypes = {"k": kv, "v": kv, "latent": kv, "state": _TORCH_DTYPES[spec.state_dtype],
              "conv": _TORCH_DTYPES[spec.conv_dtype]}
    layout = [{key: ((num_blocks if key in BLOCK_KEYS else num_slots, *shape), dtypes[key])
               for key, shape in shapes.items()} for shapes in layer_shapes(spec, block_size)]
    flat = [item for layer in layout for item in layer.values()]
    # on CPU, one mapping on huge pages (decode streams the state slots, as it does the weights)
    tensors = hugepages.zeros(flat) if torch.device(device or "cpu").type == "cpu" else None
    if tensors is None:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in flat]
    it = iter(tensors)
    return [LayerCache(**{key: next(it) for key in layer}) for layer in layout]
