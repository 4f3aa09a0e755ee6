"""Recurrent SSD (Mamba-2 decode): the recurrent gated linear attention in SSD's variable names.

Same mapping as chunk_ssd (q = C, k = B, v = x dt, g = dt A, scale 1, + D x, optional silu(z)) and
the same state API as every recurrent form here (kvstate/ops/_recurrent_delta.py): in-place
updates of a state pool by `state_indices`, all intermediate states for speculative rollback.
Unlike transformers' decode path, dt_limit is applied here too, so decode matches prefill.
"""

from __future__ import annotations

import math

from kvstate.ops.gated_linear_attention.recurrent import recurrent_gated_linear_attention
from kvstate.ops.ssd._args import check_ssd, discretize, finish


def recurrent_ssd(x, dt, A, B, C, *, D=None, z=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                  initial_state=None, output_final_state=False, cu_seqlens=None, output_all_states=False,
                  inplace_final_state=False, state_indices=None):
    """x [B, T, H, P], dt [B, T, H], A [H], B/C [B, T, G, N]. Returns (y, final_state[, all_states])."""
    check_ssd(x, dt, A, B, C, D, z, dt_bias)
    dt, log_a = discretize(x, dt, A, dt_bias, dt_softplus, dt_limit)
    out = recurrent_gated_linear_attention(C.to(dt.dtype), B.to(dt.dtype), x.to(dt.dtype) * dt.unsqueeze(-1), log_a,
                                           scale=1.0, initial_state=initial_state,
                                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                           output_all_states=output_all_states,
                                           inplace_final_state=inplace_final_state, state_indices=state_indices)
    return (finish(out[0], x, D, z),) + tuple(out[1:])
