"""Plain helpers on top of the decoder: a full forward over padded rows and one-sequence greedy generate.

Both run through the same packed-batch forward and cache pools as the engine: here every
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


@torch.inference_mode()
def greedy_generate(model, prompt: list[int], max_new_tokens: int, *, eos_token_ids: set[int] | None = None,
                    prefill_chunk: int | None = None) -> list[int]:
    """Greedy continuation of one prompt: prefill (optionally in chunks), then token-by-token decode."""
    max_len = len(prompt) + max_new_tokens
    caches = contiguous_caches(model, 1, max_len)
    step = prefill_chunk or len(prompt)
    done = 0
    while done < len(prompt):
        piece = prompt[done : done + step]
        batch = Batch.build([len(piece)], [done], [0], [[0]], max_len, device=model.device)
        logits = model(torch.tensor(piece, device=model.device), batch, caches)
        done += len(piece)
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits[-1].argmax())
        out.append(token)
        if eos_token_ids and token in eos_token_ids or len(out) == max_new_tokens:
            break
        batch = Batch.build([1], [len(prompt) + len(out) - 1], [0], [[0]], max_len, device=model.device)
        logits = model(torch.tensor([token], device=model.device), batch, caches)
    return out
