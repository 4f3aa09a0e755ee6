"""Recurrent states at positions inside a prefill chunk, from one forward over the chunk.

Prefix caching keeps a copy of each linear layer's state at snapshot positions. Ending an engine
step at each of them costs the whole model a step (every projection, MLP and attention layer
runs on a shorter chunk); here only the recurrence is cut there: `states_at` runs any form that
follows the ops contract (`naive_*`, `chunk_*`; `(**tokens, initial_state, output_final_state,
cu_seqlens, **kw) -> (o, final)`) over each sequence's segments between its requested positions,
every sequence's r-th segment packed into one call, carrying the state from segment to segment.
The output and final state are those of one call over the whole chunk (the same recurrence, its
chunk grid restarting at each position), and the state at a position is the final state of the
segment that ends there. `conv_windows_at` reads the short conv's window at a position from the
chunk's own inputs.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

import torch


def states_at(form: Callable, tokens: dict[str, torch.Tensor], *, positions: list[list[int]],
              initial_state: torch.Tensor, cu_seqlens: list[int], **kw):
    """tokens {name: [1, T, ...]} packed by `cu_seqlens` (host list [N + 1]); `positions[i]`: sorted
    token counts 0 < p < len_i into sequence i after which its state is wanted. Returns (o [1, T, ...],
    final [N, *state], states: per sequence the list of [*state] at its positions)."""
    n = len(cu_seqlens) - 1
    if not any(positions):
        o, final = form(**tokens, initial_state=initial_state, output_final_state=True,
                        cu_seqlens=_tensor(cu_seqlens, initial_state.device), **kw)
        return o, final, [[] for _ in range(n)]
    cuts = [[cu_seqlens[i], *(cu_seqlens[i] + p for p in positions[i]), cu_seqlens[i + 1]] for i in range(n)]
    state = initial_state.clone()
    out, states = None, [[] for _ in range(n)]
    for r in range(max(len(c) for c in cuts) - 1):
        seqs = [i for i in range(n) if len(cuts[i]) - 1 > r]
        spans = [(cuts[i][r], cuts[i][r + 1]) for i in seqs]
        cu = _tensor([0, *accumulate(b - a for a, b in spans)], initial_state.device)
        idx = torch.tensor(seqs, dtype=torch.int64, device=initial_state.device)
        if len(spans) == 1:  # one sequence's segment: contiguous rows, views (no gathered copies)
            rows = slice(*spans[0])
            part = {name: t[:, rows] for name, t in tokens.items()}
        else:
            rows = torch.cat([torch.arange(a, b) for a, b in spans]).to(initial_state.device)
            part = {name: t.index_select(1, rows) for name, t in tokens.items()}
        o, final = form(**part, initial_state=state.index_select(0, idx), output_final_state=True, cu_seqlens=cu,
                        **kw)
        if out is None:
            out = o.new_empty(o.shape[0], next(iter(tokens.values())).shape[1], *o.shape[2:])
        if isinstance(rows, slice):
            out[:, rows] = o
        else:
            out.index_copy_(1, rows, o)
        state.index_copy_(0, idx, final.to(state.dtype))
        for j, i in enumerate(seqs):
            if r < len(cuts[i]) - 2:  # this segment ends at a requested position
                states[i].append(final[j])
    return out, state, states


def conv_windows_at(window: torch.Tensor, x: torch.Tensor, positions: list[int]) -> list[torch.Tensor]:
    """The conv window of one sequence after its first p tokens, for each p: window [D, S] before
    the chunk, x [q, D] its chunk's inputs -> [D, S] each (the last S columns of window, x[:p])."""
    full = torch.cat([window, x.T.to(window.dtype)], dim=-1)  # [D, S + q]
    s = window.shape[-1]
    return [full[:, p:p + s] for p in positions]


def _tensor(xs: list[int], device) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=device)
