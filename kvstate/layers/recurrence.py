"""The one recurrence path of the linear mixers (Gated DeltaNet, KDA, Mamba-2, Mamba-1).

A mixer kind plugs in its two ops (`RecurrentOps`: the chunk form for prefill, the recurrent form
for decode) and hands over its per-token inputs; this module owns everything around them:
- the step's mode, per entry, as the batch carries it (`Batch.groups`): decode entries run the
  recurrent op on [n, 1, ...] and prefill entries the chunk op on one packed [1, T, ...] with
  their own cu_seqlens, so a step that mixes both runs each entry through the right op;
- the state rows: entries with an empty cache start from zeros; decode updates the pool's rows in
  place (`state_indices`), prefill reads the rows, runs, and writes the final states back;
- the short causal conv before the mixer, with the same split and its conv-window slots
  (`kernel` or `kernel - 1` columns, as the cache spec sizes them).
- "verify" entries (speculative decoding: the last known token and k drafts, [1, k+1] each, packed
  with cu_seqlens) run the recurrent op with `output_all_states`: the pool gets the state after
  the last token, and the state (and conv window) after every token is left in `batch.rollback`;
  once the engine knows how many tokens each entry keeps, `keep_states` writes that one back.
  (The compiled verify kernel, `kernels.decode.gdn_verify`, leaves the pool at each entry's first
  token instead, which is always kept: a rollback entry says which.)
  Rollback is choosing a state the forward already computed: no recompute.
- captures (prefix caching's snapshots inside a prefill chunk, `batch.captures`): the state after
  an entry's first k tokens goes to another slot, from the same forward (`ops.states_at`: the
  recurrence runs the segments between the positions; the conv window is read from the inputs).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch

from kvstate.kernels import decode as kdecode
from kvstate.ops import causal_conv1d, causal_conv1d_update
from kvstate.ops.states_at import conv_windows_at, states_at
from kvstate.profiling import timed


@dataclass(frozen=True)
class RecurrentOps:
    """A mixer kind's two forms of its recurrence, both `(**inputs, initial_state=, ...) -> (o, state)`."""

    chunk: Callable  # prefill: cu_seqlens, initial_state, output_final_state
    recurrent: Callable  # decode: one token per sequence, the pool's rows updated (state_indices, inplace_final_state)
    # whether `chunk` takes state_positions and returns those states from its own scan (else
    # ops.states_at runs it over the segments between them)
    chunk_positions: bool = False


def clear_fresh(pool: torch.Tensor, group) -> None:
    """Zero the slots of the group's entries whose cache is empty (they start from zeros)."""
    if group.fresh_slots is not None:
        pool.index_fill_(0, group.fresh_slots, 0)


def _rows(pool: torch.Tensor, group) -> torch.Tensor:
    """The group's slots of `pool` [num_slots, *shape] -> [n, *shape]; an empty cache reads zeros."""
    clear_fresh(pool, group)
    return pool.index_select(0, group.slots)


def _write(pool: torch.Tensor, group, rows: torch.Tensor) -> None:
    """rows [n, *shape] -> the group's slots. A conv pool of kernel - 1 columns keeps the newest ones."""
    pool.index_copy_(0, group.slots, rows[..., -pool.shape[-1]:].to(pool.dtype))


def _scatter(parts: list[tuple[object, torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """[(rows, out [T_g, ...])] of the groups -> [T, ...] in batch order."""
    if len(parts) == 1:
        return parts[0][1]
    first = parts[0][1]
    out = first.new_empty(num_tokens, *first.shape[1:])
    for rows, o in parts:
        if isinstance(rows, slice):
            out[rows] = o
        else:
            out.index_copy_(0, rows, o)
    return out


def short_conv(x: torch.Tensor, pool: torch.Tensor, batch, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None) -> torch.Tensor:
    """The short causal depthwise conv of a linear mixer: x [T, D] -> [T, D], carrying each entry's
    conv window [D, W or W-1] in its slot of `pool` (one-step update for decode, varlen for prefill)."""
    parts = []
    for group in batch.groups:
        xg = x[group.rows]  # [T_g, D]
        if group.mode == "decode":
            y = _conv_decode(xg, pool, group, weight, bias, activation)
        else:
            state = _rows(pool, group)  # [n, D, S]
            y, final = causal_conv1d(xg[None], weight, bias, activation=activation, initial_state=state,
                                     output_final_state=True, cu_seqlens=group.cu_seqlens)
            y = y[0]
            _capture_windows(pool, state, xg, batch, group)
            _write(pool, group, final)
            if group.mode == "verify":
                batch.rollback.append((pool, group, _windows(state, xg, batch, group), False))
        parts.append((group.rows, y))
    return _scatter(parts, x.shape[0])


@timed("conv")
def _conv_decode(x: torch.Tensor, pool: torch.Tensor, group, weight: torch.Tensor, bias: torch.Tensor | None,
                 activation: str | None) -> torch.Tensor:
    """One token per entry: the compiled step shifts the pool's windows in place, or torch on a copy."""
    clear_fresh(pool, group)
    y = kdecode.conv_update(x, pool, group.slots, weight, bias, activation)
    if y is None:
        state = pool.index_select(0, group.slots)  # [n, D, S]
        y = causal_conv1d_update(x, state, weight, bias, activation=activation)  # shifts `state` in place
        _write(pool, group, state)
    return y


def _captures(batch, group) -> list[list[tuple[int, int]]]:
    """Per entry of the group, its captures [(k, slot)] (empty lists when it has none)."""
    return [batch.captures.get(e, []) for e in group.entries]


def _capture_windows(pool: torch.Tensor, state: torch.Tensor, x: torch.Tensor, batch, group) -> None:
    """Each capture's conv window after its first k tokens -> its slot: state [n, D, S] before the step, x [T_g, D]."""
    if not batch.captures:
        return
    start = 0
    for j, (e, caps) in enumerate(zip(group.entries, _captures(batch, group))):
        q = batch.query_lens[e]
        if caps:
            windows = conv_windows_at(state[j], x[start:start + q], [k for k, _ in caps])
            for (_, slot), w in zip(caps, windows):
                pool[slot].copy_(w[..., -pool.shape[-1]:])
        start += q


def _windows(state: torch.Tensor, x: torch.Tensor, batch, group) -> torch.Tensor:
    """The conv window after every token of the group: state [n, D, S] (before the step), x [T_g, D]
    -> [T_g, D, S]; token j of an entry leaves the last S columns of (window, its tokens up to j)."""
    out, start = [], 0
    for j, e in enumerate(group.entries):
        q = batch.query_lens[e]
        full = torch.cat([state[j], x[start : start + q].T.to(state.dtype)], dim=-1)  # [D, S + q]
        out.append(full.unfold(-1, state.shape[-1], 1)[:, 1:].transpose(0, 1))  # [q, D, S]
        start += q
    return torch.cat(out)


def keep_states(batch, keep: dict[int, int]) -> None:
    """Roll the verify entries back: entry i (batch index) keeps the state after its first `keep[i]`
    tokens (>= 1). `batch.rollback` holds (pool, group, states [T_g, *row], first): the pool holds
    each entry's state after its first token (`first`) or after all of them; only other counts are
    written."""
    # row by row into the pool's own rows (an index_select would first copy each kept state, ~1 MiB
    # per layer on the 0.5b model, into a fresh tensor): every layer's rows in one compiled call
    dst, dst_rows, src, src_rows = [], [], [], []
    host_slots: dict[int, list[int]] = {}
    for pool, group, states, first in batch.rollback:
        start = 0
        for j, e in enumerate(group.entries):
            q = batch.query_lens[e]
            k = keep.get(e, q)
            if not 1 <= k <= q:
                raise ValueError(f"entry {e} cannot keep {k} of its {q} verified tokens")
            if k != (1 if first else q):
                slots = host_slots.get(id(group))
                if slots is None:
                    slots = host_slots[id(group)] = group.slots.tolist()
                dst.append(pool), dst_rows.append(slots[j]), src.append(states), src_rows.append(start + k - 1)
            start += q
    batch.rollback.clear()
    if dst and not kdecode.copy_rows(dst, dst_rows, src, src_rows):
        for pool, d, states, r in zip(dst, dst_rows, src, src_rows):
            pool[d].copy_(states[r])


def recur(ops: RecurrentOps, pool: torch.Tensor, batch, tokens: dict[str, torch.Tensor], *,
          prefill: dict | None = None, decode: dict | None = None, **shared) -> torch.Tensor:
    """Run the recurrence over the step: `tokens` are the per-token inputs [T, ...] by the ops' argument
    names, `shared` the other arguments of both forms, `prefill` / `decode` those of one form only.
    Reads and writes the entries' states in `pool` [num_slots, *state]; returns o [T, ...]."""
    only = {"prefill": prefill or {}, "decode": decode or {}, "verify": decode or {}}  # verify: the recurrent op
    parts = []
    for group in batch.groups:
        o = _RUN[group.mode](ops, pool, group, tokens, {**shared, **only[group.mode]}, batch)
        parts.append((group.rows, o.reshape(group.num_tokens, *o.shape[2:])))
    return _scatter(parts, next(iter(tokens.values())).shape[0])


def _prefill(ops: RecurrentOps, pool: torch.Tensor, group, tokens: dict, kwargs: dict, batch) -> torch.Tensor:
    """The group's sequences as one packed [1, T_g, ...] through the chunk op; final states written back."""
    xs = {name: t[group.rows].unsqueeze(0) for name, t in tokens.items()}
    caps = _captures(batch, group) if batch.captures else None
    if not caps or not any(caps):
        o, state = ops.chunk(**xs, **kwargs, initial_state=_rows(pool, group), output_final_state=True,
                             cu_seqlens=group.cu_seqlens)
    else:
        positions = [[k for k, _ in c] for c in caps]
        if ops.chunk_positions:
            o, state, states = ops.chunk(**xs, **kwargs, initial_state=_rows(pool, group), output_final_state=True,
                                         cu_seqlens=group.cu_seqlens, state_positions=positions)
        else:
            lens = [batch.query_lens[e] for e in group.entries]
            o, state, states = states_at(ops.chunk, xs, positions=positions, initial_state=_rows(pool, group),
                                         cu_seqlens=[0, *accumulate(lens)], **kwargs)
        for c, got in zip(caps, states):
            for (_, slot), s in zip(c, got):
                pool[slot].copy_(s)
    _write(pool, group, state)
    return o


@timed("recurrent")
def _decode(ops: RecurrentOps, pool: torch.Tensor, group, tokens: dict, kwargs: dict, batch) -> torch.Tensor:
    """One token per sequence, [n, 1, ...], through the recurrent op, which updates the pool's rows itself."""
    xs = {name: t[group.rows].unsqueeze(1) for name, t in tokens.items()}
    clear_fresh(pool, group)
    o, _ = ops.recurrent(**xs, **kwargs, initial_state=pool, state_indices=group.slots, inplace_final_state=True)
    return o


def _verify(ops: RecurrentOps, pool: torch.Tensor, group, tokens: dict, kwargs: dict, batch) -> torch.Tensor:
    """Each entry's tokens (packed [1, T_g, ...], cu_seqlens) through the recurrent op: the pool's rows
    get the state after the last token, `batch.rollback` the state after every token."""
    xs = {name: t[group.rows].unsqueeze(0) for name, t in tokens.items()}
    clear_fresh(pool, group)
    o, _, states = ops.recurrent(**xs, **kwargs, initial_state=pool, state_indices=group.slots,
                                 inplace_final_state=True, cu_seqlens=group.cu_seqlens, output_all_states=True)
    batch.rollback.append((pool, group, states[0], False))  # [T_g, *state]; the pool at the last token
    return o


# per mode, how a group runs
_RUN = {"prefill": _prefill, "decode": _decode, "verify": _verify}
