"""Presence, frequency and repetition penalties on a batch of logits rows, as vLLM applies them.

For row i with its request's prompt and output token ids so far:

    repetition_penalty p (tokens in the prompt or the output):  x / p where x > 0, x * p otherwise
    frequency_penalty f (output tokens):                       x - f * count(token in the output)
    presence_penalty r (output tokens):                        x - r * (count > 0)

The repetition rule is transformers' RepetitionPenaltyLogitsProcessor (over prompt + output,
which is what transformers' generate sees as input_ids); presence and frequency are OpenAI's.
They act on the raw logits, before temperature and the filters, greedy rows included.
"""

from __future__ import annotations

import torch

from kvstate.engine.params import SamplingParams


def output_counts(outputs: list[list[int]], vocab: int, device) -> torch.Tensor:
    """counts [R, vocab]: how often each token occurs in each row's output."""
    counts = torch.zeros(len(outputs), vocab, device=device)
    for i, ids in enumerate(outputs):
        if ids:
            counts[i].index_add_(0, torch.tensor(ids, device=device), torch.ones(len(ids), device=device))
    return counts


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> torch.Tensor:
    """logits [R, V] (fp32) with each row's penalties; rows without any pass through unchanged."""
    rows = [i for i, p in enumerate(params) if p.penalties]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    x = logits[rows]  # [P, V]
    counts = output_counts([outputs[i] for i in rows], vocab, device)  # [P, V]
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device).unsqueeze(1)  # [P, 1]
    seen = counts > 0
    for r, i in enumerate(rows):
        if prompts[i]:
            seen[r, torch.tensor(prompts[i], device=device)] = True
    penalized = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen & (rep != 1), penalized, x)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device).unsqueeze(1)
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device).unsqueeze(1)
    x = x - freq * counts - pres * (counts > 0).to(x.dtype)
    logits[rows] = x
    return logits
