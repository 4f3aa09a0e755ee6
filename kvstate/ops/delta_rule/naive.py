"""Naive delta rule: S <- S + k (beta (v - S^T k))^T, o = S^T (scale q); the gated delta rule with g = 0."""

from __future__ import annotations

from kvstate.ops.gated_delta_rule.naive import naive_gated_delta_rule


def naive_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV]. Returns (o, final_state [N, HV, K, V] or None)."""
    return naive_gated_delta_rule(q, k, v, None, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
