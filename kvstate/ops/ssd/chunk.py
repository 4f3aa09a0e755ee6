"""Chunked SSD (Mamba-2 prefill): gated linear attention in SSD's variable names.

q = C, k = B (the groups play the key heads), v = x * dt, g = dt * A, scale = 1; then + D x and the
optional silu(z) gate. State [N_seq, H, N, P] (K = d_state, V = head_dim); transformers' Mamba2
cache holds the transpose [B, H, P, N]. Note that in Mamba-2 layers the z gate is applied by the
gated RMSNorm outside the scan, so `z` here is optional (mamba_ssm's chunk_scan accepts it).
"""

from __future__ import annotations

import math

from kvstate.ops.gated_linear_attention.chunk import chunk_gated_linear_attention
from kvstate.ops.ssd._args import check_ssd, discretize, finish


def chunk_ssd(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
              initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=32, state_positions=None):
    """x [B, T, H, P], dt [B, T, H], A [H], B/C [B, T, G, N]. Returns (y [B, T, H, P], final_state or None);
    with `state_positions`, also the states there (chunk_gated_linear_attention)."""
    check_ssd(x, dt, A, B, C, D, z, dt_bias)
    dt, log_a = discretize(x, dt, A, dt_bias, dt_softplus, dt_limit)
    y, final, *states = chunk_gated_linear_attention(
        C.to(dt.dtype), B.to(dt.dtype), x.to(dt.dtype) * dt.unsqueeze(-1), log_a, scale=1.0,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        chunk_size=chunk_size, state_positions=state_positions)
    return (finish(y, x, D, z), final, *states)
