"""Naive gated linear attention with one scalar log decay per value head (the Mamba-2 / SSD form).

Per token, for every value head (state S [K, V], the ops contract's orientation):

    S <- exp(g) S + k v^T        (g = log decay <= 0; absent for plain linear attention)
    o  = S^T (scale q)

The per-token loop (`gated_delta_rule.naive.naive_recurrence` without the delta): the truth the
chunk and recurrent forms are tested against. fp32 (fp64 for fp64 inputs); value heads grouped
over key heads like GQA.
"""

from __future__ import annotations

from kvstate.ops._inputs import prepare
from kvstate.ops.gated_delta_rule.naive import naive_recurrence


def naive_gated_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] or None.

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    prepare(q, k, v, g, None, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, needs_beta=False)
    return naive_recurrence(q, k, v, g, None, scale=scale, l2=use_qk_l2norm_in_kernel, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
