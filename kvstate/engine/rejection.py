"""Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) over a step's verify rows.

A verify entry with drafts d_1..d_k has k+1 logits rows: row i is the target's distribution p_i
of the token after d_i (row 0: after the last known token). Drafts here are one-hot (prompt
lookup, or a draft model decoding greedily): q(d_i) = 1, so d_{i+1} is accepted with probability
min(1, p_i(d_{i+1}) / q) = p_i(d_{i+1}); on the first rejection the token is drawn from the residual
max(p_i - q, 0), i.e. p_i without d_{i+1}, renormalized; after k acceptances one more token is
drawn from p_k. Every emitted token then has exactly the target's distribution. Greedy rows keep
the longest prefix of drafts that equals the argmax, then add the argmax after it: token for
token what plain greedy decoding gives. p_i is the distribution plain sampling draws from
(temperature, min_p, top_k, top_p: `process_logits`). Requests with penalties or logprobs get no
drafts (`proposer.eligible`).
"""

from __future__ import annotations

from itertools import accumulate

import torch

from kvstate.engine.sampling import SampleOutput, process_logits, sample


def verify_one(logits: torch.Tensor, drafts: list[int], params, generator) -> list[int]:
    """logits [k+1, V] of one verify entry -> the accepted drafts and the token after them."""
    k = len(drafts)
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()  # first maximum on ties, as plain greedy sampling
        out = []
        for i, d in enumerate(drafts):
            if best[i] != d:
                return out + [best[i]]
            out.append(d)
        return out + [best[k]]
    probs = process_logits(logits, [params] * (k + 1)).softmax(dim=-1)  # [k+1, V]
    u = torch.rand(k, generator=generator, device=probs.device).tolist() if k else []
    accept = probs[torch.arange(k), torch.tensor(drafts, dtype=torch.int64)].tolist() if k else []
    out = []
    for i, d in enumerate(drafts):
        if u[i] < accept[i]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0  # max(p - q, 0) for a one-hot q
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(torch.multinomial(probs[k], 1, generator=generator))]


def sample_step(logits: torch.Tensor, drafts: list[list[int]], params: list, generators: list, *,
                generator: torch.Generator | None = None, history: tuple[list, list] | None = None) -> SampleOutput:
    """The sampled entries of a step: entry j has 1 + len(drafts[j]) rows of logits [R, V], in order.
    Entries without drafts are sampled as usual (`sample`, one row each: penalties, logprobs); verify
    entries get a list of tokens (accepted drafts + one) in `token_ids`."""
    starts = [0, *accumulate(1 + len(d) for d in drafts)]
    tokens: list = [None] * len(drafts)
    logprobs: list = [None] * len(drafts)
    tops: list = [None] * len(drafts)
    plain = [j for j, d in enumerate(drafts) if not d]
    if plain:
        hist = None if history is None else tuple([h[j] for j in plain] for h in history)
        rows = torch.tensor([starts[j] for j in plain], dtype=torch.int64, device=logits.device)
        got = sample(logits.index_select(0, rows), [params[j] for j in plain], [generators[j] for j in plain],
                     generator=generator, history=hist)
        for r, j in enumerate(plain):
            tokens[j], logprobs[j], tops[j] = got.token_ids[r], got.logprobs[r], got.top_logprobs[r]
    for j, d in enumerate(drafts):
        if d:
            g = generators[j] if generators[j] is not None else generator
            tokens[j] = verify_one(logits[starts[j] : starts[j + 1]].float(), d, params[j], g)
    return SampleOutput(tokens, logprobs, tops)
