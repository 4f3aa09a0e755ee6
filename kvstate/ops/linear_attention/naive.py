"""Naive linear attention (no decay): S <- S + k v^T, o = S^T (scale q); gated LA with g = 0."""

from __future__ import annotations

from kvstate.ops.gated_linear_attention.naive import naive_gated_linear_attention


def naive_linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]. Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None)."""
    return naive_gated_linear_attention(q, k, v, None, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
