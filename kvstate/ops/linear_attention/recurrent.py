"""Recurrent linear attention (decode, no decay): S <- S + k v^T, o = S^T (scale q).

Same state API as every recurrent form here (kvstate/ops/_recurrent_delta.py).
"""

from __future__ import annotations

from kvstate.ops.gated_linear_attention.recurrent import recurrent_gated_linear_attention


def recurrent_linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                               inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]. Returns (o, final_state[, all_states])."""
    return recurrent_gated_linear_attention(q, k, v, None, scale=scale, initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                            output_all_states=output_all_states,
                                            inplace_final_state=inplace_final_state, state_indices=state_indices)
