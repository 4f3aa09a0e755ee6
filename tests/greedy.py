"""One-sequence greedy generation outside the engine: the tests' plain reference for its tokens.

It runs the decoder through the same packed-batch forward and cache pools as the engine, but with
no scheduler: the sequence gets one KV block as long as its whole context and its own state slot.
"""

from __future__ import annotations

import torch

from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches


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
