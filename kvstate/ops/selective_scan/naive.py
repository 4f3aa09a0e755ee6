"""Mamba-1 selective scan, the naive form: one token at a time, straight from the recurrence.

This is the truth the fast forms are tested against (compute it in fp64 for tight bounds):

    dt_t = softplus(delta_t + delta_bias)            (or delta_t + delta_bias without softplus)
    h_t  = exp(dt_t[:, None] * A) * h_{t-1} + (dt_t * u_t)[:, None] * B_t[None, :]     [D, N]
    y_t  = h_t @ C_t + D * u_t,   then  y_t * silu(z_t)  when z is given

the semantics of transformers' Mamba / Jamba slow path (`mamba_selective_scan`), token-first.
"""

from __future__ import annotations

import torch

from kvstate.ops._common import seq_bounds
from kvstate.ops.selective_scan.inputs import (
    check_inputs, compute_dtype, discretize_dt, epilogue, grouped, initial,
)


def naive_selective_scan(u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                         initial_state=None, output_final_state=False, cu_seqlens=None):
    """Returns (y [B, T, D] in u's dtype, final_state [N_seq, D, N] or None)."""
    shape = check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    dtype = compute_dtype(u, delta, A, B, C)
    dt = discretize_dt(delta, delta_bias, delta_softplus, dtype)
    rep = shape.dim // shape.groups
    Bd = grouped(B).to(dtype).repeat_interleave(rep, dim=2)  # [B, T, D, N]: channel d's B row
    Cd = grouped(C).to(dtype).repeat_interleave(rep, dim=2)
    x = dt * u.to(dtype)  # [B, T, D]
    h0 = initial(initial_state, shape, dtype, u.device)
    A = A.to(dtype)
    if cu_seqlens is None:
        y, h = _scan(dt, x, A, Bd, Cd, h0)
    else:
        ys, hs = [], []
        for i, (s, n) in enumerate(zip(*seq_bounds(1, dt.shape[1], cu_seqlens))):
            e = s + n
            y_i, h_i = _scan(dt[:, s:e], x[:, s:e], A, Bd[:, s:e], Cd[:, s:e], h0[i : i + 1])
            ys.append(y_i)
            hs.append(h_i)
        y, h = torch.cat(ys, dim=1), torch.cat(hs, dim=0)
    return epilogue(y, u, D, z, u.dtype), (h if output_final_state else None)


def _scan(dt, x, A, Bd, Cd, h):
    """dt, x [b, T, D]; Bd, Cd [b, T, D, N]; h [b, D, N] -> y [b, T, D], h_T."""
    ys = []
    for t in range(dt.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + x[:, t, :, None] * Bd[:, t]
        ys.append((h * Cd[:, t]).sum(-1))
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(x.shape)
    return y, h
