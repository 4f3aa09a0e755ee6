"""Chunked delta rule: the gated delta rule kernel with g = 0 (no exponentials, no decay masks)."""

from __future__ import annotations

from kvstate.ops.gated_delta_rule.chunk import chunk_gated_delta_rule


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=32):
    """q, k [B, T, H, K]; v [B, T, HV, V]; beta [B, T, HV]. Returns (o, final_state [N, HV, K, V] or None)."""
    return chunk_gated_delta_rule(q, k, v, None, beta, scale=scale, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                  chunk_size=chunk_size)
