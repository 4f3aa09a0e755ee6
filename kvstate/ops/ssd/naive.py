"""Naive SSD (Mamba-2 scan): the per-token recurrence in the SSM's own terms (the truth for tests).

For every head h (group g = h // (H / G)), with the state h_t [N, P] (d_state x head_dim):

    h_t = exp(dt_t A_h) h_{t-1} + dt_t B_t[g] x_t^T      (x_t [P], B_t[g] [N])
    y_t = h_t^T C_t[g] + D_h x_t,   then y_t * silu(z_t) when z is given

State [N_seq, H, N, P] in fp32: the ops contract's [K, V] orientation with K = d_state and
V = head_dim. transformers' Mamba2 cache holds the transpose, [B, H, P, N].
"""

from __future__ import annotations

import math

import torch

from kvstate.ops._common import check, check_cu_seqlens, seq_bounds
from kvstate.ops.ssd._args import check_ssd, discretize, finish


def naive_ssd(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
              initial_state=None, output_final_state=False, cu_seqlens=None):
    """Returns (y [B, T, H, P] in x's dtype, final_state [N_seq, H, N, P] fp32 or None)."""
    check_ssd(x, dt, A, B, C, D, z, dt_bias)
    b, t, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    check_cu_seqlens(cu_seqlens, b, t)
    starts, lens = seq_bounds(b, t, cu_seqlens)
    if initial_state is not None:
        check("initial_state", initial_state, shape=(len(lens), h, n, p))
    dt, log_a = discretize(x, dt, A, dt_bias, dt_softplus, dt_limit)
    acc = dt.dtype
    xf = x.reshape(b * t, h, p).to(acc)
    dtf, laf = dt.reshape(b * t, h), log_a.reshape(b * t, h)
    bf = B.reshape(b * t, g, n).to(acc).repeat_interleave(h // g, dim=1)  # [tot, H, N]
    cf = C.reshape(b * t, g, n).to(acc).repeat_interleave(h // g, dim=1)
    y = torch.empty_like(xf)
    finals = []
    for i, (s, length) in enumerate(zip(starts, lens)):
        st = torch.zeros(h, n, p, dtype=acc, device=x.device) if initial_state is None else initial_state[i].to(acc)
        for j in range(s, s + length):
            st = laf[j].exp()[:, None, None] * st + dtf[j][:, None, None] * bf[j][:, :, None] * xf[j][:, None, :]
            y[j] = torch.einsum("hnp,hn->hp", st, cf[j])
        finals.append(st)
    final = torch.stack(finals) if finals else xf.new_zeros(0, h, n, p)
    y = finish(y.view(b, t, h, p), x, D, None if z is None else z)
    return y, (final if output_final_state else None)
