"""KDA, the naive form: one token at a time, written to be read. The truth the fast forms match.

Per token t, per value head (state S [K, V], k as column, v as row):

    S <- diag(exp(g_t)) S                      decay each key row k by exp(g_t[k])
    u  = beta_t * (v_t - S^T k_t)              the delta: what the decayed state gets wrong
    S <- S + k_t u^T                           the write
    o_t = S^T (scale * q_t)                    the read, after the write

Same semantics as transformers' `recurrent_kimi_delta_attention` (Kimi Linear). Computes in fp32,
or fp64 when an input is fp64. Varlen batches run sequence by sequence, with no padding trick.
The loop is the gated delta rule's (`gated_delta_rule.naive.naive_recurrence`) with g per channel.
"""

from __future__ import annotations

from kvstate.ops._inputs import prepare
from kvstate.ops.gated_delta_rule.naive import naive_recurrence


def naive_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV] -> (o [B, T, HV, V], state).

    state: [N, HV, K, V] (N = B, or the number of sequences of a packed batch) or None.
    """
    prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, needs_beta=True,
            g_shape="channel")
    return naive_recurrence(q, k, v, g, beta, scale=scale, l2=use_qk_l2norm_in_kernel, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
