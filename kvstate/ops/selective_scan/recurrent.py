"""Mamba-1 selective scan, the decode form: one or a few tokens per sequence, state carried.

Same semantics and arguments as `naive_selective_scan`, plus `output_all_states` (the state after
every token of the call, [B, T, D, N], for rolling back rejected speculative tokens). Each token
costs four in-place passes over the [B, D, N] state (a = exp(dt A); a *= h; a += x B; y = a . C)
into preallocated buffers, a few sequences at a time so the passes hit the cache, not memory.
When autograd must record (inputs that require grad) the same steps run out of place: slower but
differentiable; train with `chunk_selective_scan`. The initial_state tensor is never written,
except as a state pool: the state API of every recurrent form (`state_indices`: the pool row of
each sequence; `inplace_final_state=True`: those rows get the final states).
"""

from __future__ import annotations

import torch

from kvstate.ops._common import pack, unpack
from kvstate.ops.selective_scan.inputs import (
    BUDGET, check_inputs, compute_dtype, discretize_dt, epilogue, grouped, initial,
)


def recurrent_selective_scan(u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                             initial_state=None, output_final_state=False, cu_seqlens=None,
                             output_all_states=False, inplace_final_state=False, state_indices=None):
    """Returns (y [B, T, D], final_state [N_seq, D, N] or None[, all_states [B, T, D, N]]).
    With inplace_final_state, final_state is initial_state, its rows state_indices (default 0..N-1) updated.

    With cu_seqlens (packed [1, sum(T), ...]) all_states is packed too: [1, sum(T), D, N].
    """
    pool = initial_state
    if state_indices is not None or inplace_final_state:
        if pool is None or torch.is_grad_enabled() and pool.requires_grad:
            raise ValueError("state_indices / inplace_final_state need a state pool initial_state (no autograd)")
        if state_indices is not None:  # [N_seq, D, N]: the scan steps on contiguous rows
            initial_state = pool.index_select(0, state_indices)
    shape = check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    dtype = compute_dtype(u, delta, A, B, C)
    dt = discretize_dt(delta, delta_bias, delta_softplus, dtype)
    x = dt * u.to(dtype)
    Bg, Cg = grouped(B).to(dtype), grouped(C).to(dtype)
    h0 = initial(initial_state, shape, dtype, u.device)
    if cu_seqlens is not None:
        # Right-pad each sequence with dt = 0, x = 0: its state stays exactly as it was.
        dt, x, Bg, Cg = (unpack(t, cu_seqlens) for t in (dt, x, Bg, Cg))
    inputs = (dt, x, A, Bg, Cg, h0)
    steps = _steps_autograd if torch.is_grad_enabled() and any(v.requires_grad for v in inputs) else _steps
    y, h, states = steps(dt, x, A.to(dtype), Bg, Cg, h0, output_all_states)
    if cu_seqlens is not None:
        y = pack(y, cu_seqlens) if y.shape[1] else y.new_zeros(1, 0, shape.dim)
        if states is not None:
            states = pack(states, cu_seqlens) if states.shape[1] else states.new_zeros(1, 0, *h.shape[1:])
    y = epilogue(y, u, D, z, u.dtype)
    if inplace_final_state:
        if state_indices is None:
            pool.copy_(h)
        else:
            pool.index_copy_(0, state_indices, h.to(pool.dtype))
        h, output_final_state = pool, True
    out = (y, h if output_final_state else None)
    return out + (states,) if output_all_states else out


def _steps(dt, x, A, Bg, Cg, h, keep_all: bool):
    """dt, x [b, T, D]; Bg, Cg [b, T, G, N]; h [b, D, N] -> y [b, T, D], h_T, all states or None."""
    b, t_len, d = dt.shape
    g, n = Bg.shape[2], Bg.shape[3]
    y = dt.new_empty(b, t_len, d)
    states = dt.new_empty(b, t_len, d, n) if keep_all else None
    # a few sequences at a time, so the four passes over the state stay in cache (measured ~2x)
    step = max(1, BUDGET // (d * n))
    A = A.view(g, d // g, n)
    spare = None
    for t in range(t_len):
        # ping-pong between two buffers unless every state is kept; never overwrite the input h
        if keep_all:
            buf = states[:, t]
        else:
            buf = spare if spare is not None else torch.empty_like(h)
            spare = h if t > 0 else None
        for s in range(0, b, step):
            e = min(b, s + step)
            a = buf[s:e].view(e - s, g, d // g, n)
            torch.mul(dt[s:e, t].view(e - s, g, d // g, 1), A, out=a)
            a.exp_()
            a.mul_(h[s:e].view(e - s, g, d // g, n))
            a.addcmul_(x[s:e, t].view(e - s, g, d // g, 1), Bg[s:e, t, :, None, :])
            torch.linalg.vecdot(a, Cg[s:e, t, :, None, :], out=y[s:e, t].view(e - s, g, d // g))
        h = buf
    # the final state never aliases the caller's initial_state nor all_states
    return y, h.clone() if keep_all or not t_len else h, states


def _steps_autograd(dt, x, A, Bg, Cg, h, keep_all: bool):
    """The same recurrence out of place, for when autograd records (slower, differentiable)."""
    b, t_len, d = dt.shape
    g, n = Bg.shape[2], Bg.shape[3]
    ys, hs = [], []
    for t in range(t_len):
        a = torch.exp(dt[:, t].view(b, g, d // g, 1) * A.view(g, d // g, n))
        h = (a * h.view(b, g, d // g, n) + x[:, t].view(b, g, d // g, 1) * Bg[:, t, :, None, :]).view(b, d, n)
        ys.append(torch.linalg.vecdot(h.view(b, g, d // g, n), Cg[:, t, :, None, :]).view(b, d))
        hs.append(h)
    y = torch.stack(ys, 1) if ys else dt.new_zeros(b, 0, d)
    states = (torch.stack(hs, 1) if hs else dt.new_zeros(b, 0, d, n)) if keep_all else None
    return y, h if t_len else h.clone(), states
