"""Chunked linear attention (no decay): the gated linear attention kernel with g = 0.

With no decay the kernel skips every exponential: O = Q S0 + tril(Q K^T) V per chunk.
"""

from __future__ import annotations

from kvstate.ops.gated_linear_attention.chunk import chunk_gated_linear_attention


def chunk_linear_attention(q, k, v, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=32):
    """q, k [B, T, H, K]; v [B, T, HV, V]. Returns (o [B, T, HV, V], final_state [N, HV, K, V] or None)."""
    return chunk_gated_linear_attention(q, k, v, None, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                        chunk_size=chunk_size)
