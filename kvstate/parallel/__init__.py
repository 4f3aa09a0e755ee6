"""Tensor parallelism (Megatron-style) over torch.distributed: gloo on CPU, one process per rank.

- `plan` (no torch): each rank's layer plan (its heads, channels, experts and vocabulary rows),
  so the cache spec and the memory planner give per-device shapes and bytes; what does not divide.
- `comm`: the process group (gloo, timeouts) and the few collectives the model needs.
- `shard`: which rows / columns of every full parameter a rank holds; the loader reads only those.
- `model`: loads a rank's shard and adds the collectives (all-reduce after row-parallel parts,
  vocabulary-parallel embedding and LM head).
- `engine`: rank 0 schedules and broadcasts each step's plain data; workers run their shard.
Import the torch modules explicitly: this package stays importable without torch.
"""
