"""Shared driver of the recurrent (decode) forms of the q/k/v ops (delta rule, gated delta rule,
(gated) linear attention, SSD, KDA): state blocks that stay in cache.

Decode is memory-bound: each step must read and write every state once (32 sequences x 32 heads x
128 x 128 fp32 = 64 MiB for Qwen3.5-size layers). A token's update needs several passes over its
state (decay, read S^T k and S^T q, write k u^T); done over the whole batch, each pass goes to
DRAM. Instead we walk the state a block at a time (about BLOCK_BYTES: a few heads of one sequence,
or several whole sequences when each has one token) and run every token of the call on that
block while it sits in cache, so DRAM sees about one read and
one write of each state, as in a fused kernel. Blocks are independent, so big calls spread them
over worker threads (kvstate/ops/_threads.py). An op brings only its per-token update, a `step`
over rows of its flattened [tokens x HV] inputs.

State API (for the engine):
- `initial_state` [P, HV, K, V]; row `state_indices[n]` (default n) is sequence n's state.
- `inplace_final_state=True` updates those rows of `initial_state` in place (it must be fp32,
  contiguous; the indices must be distinct) and returns `initial_state` itself as the final
  state: no copy of the state pool, and no fresh 64 MiB to page in.
- `output_all_states=True` also returns the state after every token of the call, [B, T, HV, K, V]
  (packed: [1, sum T, ...]), so that rejected speculative tokens can be rolled back.
Recurrent forms are inference kernels: they do not support autograd (use the chunk forms).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch

from kvstate.ops import _threads
from kvstate.ops._inputs import FlatInputs, normalize_qk

BLOCK_BYTES = 2 << 20  # state bytes per block: about one core's L2


def _check_state_args(flat: FlatInputs, state_indices, inplace_final_state: bool) -> None:
    """The recurrent forms' state arguments: no autograd; `state_indices` (one row of the pool
    `initial_state` per sequence); `inplace_final_state` needs a contiguous `acc` state to write into."""
    n_seq, acc, initial_state = flat.n_seq, flat.acc, flat.s0
    inputs = (flat.q, flat.k, flat.v, flat.g, flat.beta, initial_state)
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        raise ValueError("recurrent forms do not support autograd; use the chunk form for training")
    if state_indices is not None:
        if initial_state is None:
            raise ValueError("state_indices needs initial_state (the state pool it indexes)")
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 1 \
                or state_indices.dtype.is_floating_point or state_indices.numel() != n_seq:
            raise ValueError(f"state_indices must be a 1-D integer tensor with one entry per sequence ({n_seq})")
        rows = initial_state.shape[0]
        if state_indices.numel() and (int(state_indices.min()) < 0 or int(state_indices.max()) >= rows):
            raise ValueError(f"state_indices must lie in [0, {rows})")
    if inplace_final_state:
        if initial_state is None:
            raise ValueError("inplace_final_state needs initial_state (the state updated in place)")
        if initial_state.dtype != acc or not initial_state.is_contiguous():
            raise ValueError(f"initial_state must be a contiguous {acc} tensor for inplace_final_state")


def _blocks(flat: FlatInputs, merge: bool) -> list[tuple[int, int, int, int]]:
    """State blocks (first sequence, end sequence, first head, end head) of about BLOCK_BYTES.

    A block is a head range of one sequence, or with `merge` (one token per sequence, states in
    consecutive rows) several whole sequences, so that small states still make big blocks.
    """
    _, hv, dk, dv = flat.dims
    nb = max(1, min(hv, BLOCK_BYTES // (dk * dv * 4)))
    if merge and nb == hv:
        per = max(1, BLOCK_BYTES // (hv * dk * dv * 4))
        return [(n, min(flat.n_seq, n + per), 0, hv) for n in range(0, flat.n_seq, per)]
    return [(n, n + 1, h0, min(hv, h0 + nb)) for n in range(flat.n_seq) for h0 in range(0, hv, nb)]


def _mergeable(flat: FlatInputs, output_all_states: bool, state_indices) -> bool:
    return not output_all_states and state_indices is None and all(n == 1 for n in flat.lens)


def run(flat: FlatInputs, build: Callable, *, l2: bool, output_final_state: bool, output_all_states: bool,
        inplace_final_state: bool, state_indices: torch.Tensor | None):
    """A recurrent form's call: check the state arguments, then build(q, k) -> (step, o [rows, ...] in
    flat.acc) and drive `step` (see `_drive`) over the state blocks, in parallel for big calls.
    build gets q, k [tot, H, K] in flat.acc, L2-normalized if `l2`, q scaled by flat.scale.

    `build` runs inside the workers' scope (single-threaded torch ops: the blocks bring their own
    parallelism). Returns (o [B, T, HV, V] in the input dtype, final_state or None[, all_states]).
    """
    _check_state_args(flat, state_indices, inplace_final_state)
    _, hv, dk, dv = flat.dims
    merge = _mergeable(flat, output_all_states, state_indices)
    blocks = _blocks(flat, merge)
    with _threads.scope(flat.q.shape[0] * hv * dk * dv, len(blocks)) as n_work:
        step, o = build(*normalize_qk(flat.q, flat.k, flat.acc, l2, scale=flat.scale))
        final, all_states = _drive(flat, step, blocks, merge, n_work=n_work, output_final_state=output_final_state,
                                   output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                                   state_indices=state_indices)
    out = (o.to(flat.dtype).view(flat.out_shape), final)
    return out + (all_states,) if output_all_states else out


def _drive(flat: FlatInputs, step: Callable, blocks: list, merge: bool, *, n_work: int, output_final_state: bool,
           output_all_states: bool, inplace_final_state: bool, state_indices: torch.Tensor | None):
    """Drive step(r0, r1, s_in, s_out) over the state blocks and tokens, on n_work workers.

    Rows r0..r1 index the flattened [tokens x HV] inputs (token t, value head h is row t * HV + h);
    `step` must compute their update from s_in [r1 - r0, K, V] into s_out (which may be s_in
    itself: update in place) and write their outputs. Returns (final_state or None, all_states or None).
    """
    _, hv, dk, dv = flat.dims
    dev, acc = flat.q.device, flat.acc
    src = flat.s0
    seq_rows = list(range(flat.n_seq)) if state_indices is None else state_indices.tolist()
    if inplace_final_state:
        final = src
    elif output_final_state:
        final = torch.empty(flat.n_seq, hv, dk, dv, dtype=acc, device=dev)
    else:
        final = None
    all_states = torch.empty(flat.q.shape[0] * hv, dk, dv, dtype=acc, device=dev) if output_all_states else None
    # merged blocks address states as rows [N * HV, K, V] (views; a strided initial_state is copied once)
    src_rows = src.reshape(-1, dk, dv) if merge and src is not None else None
    final_rows = final.reshape(-1, dk, dv) if merge and final is not None else None

    def run_blocks(part):
        scratch = None
        for n0, n1, h0, h1 in part:
            if merge and h1 - h0 == hv:  # sequences n0..n1, one token each (token n): one step for all rows
                rows = slice(n0 * hv, n1 * hv)
                s = None if src is None else src_rows[rows]
                dst = None if final is None else final_rows[rows]
                steps = [(n0 * hv, n1 * hv)]
            else:
                s = None if src is None else src[seq_rows[n0], h0:h1]
                dst = None if final is None else final[n0, h0:h1]
                steps = [(t * hv + h0, t * hv + h1) for t in range(flat.starts[n0], flat.starts[n0] + flat.lens[n0])]
            if inplace_final_state:
                dst = s
            elif dst is None:  # no final state wanted: update a scratch block
                size = (n1 - n0) * (h1 - h0)
                if scratch is None or scratch.shape[0] < size:
                    scratch = torch.empty(size, dk, dv, dtype=acc, device=dev)
                dst = scratch[:size]
            for r0, r1 in steps:
                # the first token reads the initial state and writes the destination: no copy pass
                s_out = dst if all_states is None else all_states[r0:r1]
                if s is None:
                    s = s_out.zero_()
                step(r0, r1, s, s_out)
                s = s_out
            if dst is not s:  # empty sequence, or the last state went to all_states
                dst.zero_() if s is None else dst.copy_(s)

    # blocks are independent (distinct state rows, disjoint outputs): spread them over workers
    _threads.run([partial(run_blocks, blocks[a:b]) for a, b in _threads.split(len(blocks), n_work)])
    if all_states is not None:
        all_states = all_states.view(*flat.out_shape[:2], hv, dk, dv)
    return final, all_states
