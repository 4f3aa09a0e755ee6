"""A plain helper on top of the decoder: a full forward over padded rows.

It runs through the same packed-batch forward and cache pools as the engine: here every
sequence gets one KV block as long as its whole context and its own state slot.
"""

from __future__ import annotations

import torch

from kvstate.cache.pools import allocate_pools
from kvstate.cache.spec import cache_spec
from kvstate.models.batch import Batch


def contiguous_caches(model, num_seqs: int, max_len: int, dtype: str = "float32", *, conv_window: str = "kernel"):
    """Pools from the model's cache spec where sequence i owns KV block i (block_size = max_len) and
    state slot i; KV, state and conv in `dtype`."""
    spec = cache_spec(model.plan, kv_dtype=dtype, state_dtype=dtype, conv_dtype=dtype, conv_window=conv_window)
    return allocate_pools(spec, num_blocks=num_seqs, block_size=max_len, num_slots=num_seqs, device=model.device)


@torch.inference_mode()
def forward_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Logits [T_i, vocab] for every position of every sequence, all run as one packed batch."""
    n, max_len = len(sequences), max(len(s) for s in sequences)
    caches = contiguous_caches(model, n, max_len)
    batch = Batch.build([len(s) for s in sequences], [0] * n, list(range(n)), [[i] for i in range(n)], max_len,
                        logits="all", device=model.device)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=model.device)
    logits = model(ids, batch, caches)
    return list(logits.split([len(s) for s in sequences]))
