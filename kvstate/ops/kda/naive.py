"""KDA, the naive form: one token at a time, written to be read. The truth the fast forms match.

Per token t, per value head (state S [K, V], k as column, v as row):

    S <- diag(exp(g_t)) S                      decay each key row k by exp(g_t[k])
    u  = beta_t * (v_t - S^T k_t)              the delta: what the decayed state gets wrong
    S <- S + k_t u^T                           the write
    o_t = S^T (scale * q_t)                    the read, after the write

Same semantics as transformers' `recurrent_kimi_delta_attention` (Kimi Linear). Computes in fp32,
or fp64 when an input is fp64. Varlen batches run sequence by sequence, with no padding trick.
"""

from __future__ import annotations

import torch

from kvstate.ops.kda._args import prepare


def _run(q, k, v, g, beta, state):
    """q, k, g [B, T, HV, K], v [B, T, HV, V], beta [B, T, HV], state [B, HV, K, V] -> (o, state)."""
    outs = []
    for t in range(q.shape[1]):
        state = state * g[:, t].exp().unsqueeze(-1)
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return o, state


def naive_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV] -> (o [B, T, HV, V], state).

    state: [N, HV, K, V] (N = B, or the number of sequences of a packed batch) or None.
    """
    x = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
    q, k = x.qk(x.q, x.k)
    state = x.zero_state()
    if cu_seqlens is None:
        o, final = _run(q, k, x.v, x.g, x.beta, state)
    else:
        bounds = cu_seqlens.tolist()
        outs, finals = [], []
        for i in range(x.num_seqs):
            sl = slice(bounds[i], bounds[i + 1])
            o_i, s_i = _run(q[:, sl], k[:, sl], x.v[:, sl], x.g[:, sl], x.beta[:, sl], state[i : i + 1])
            outs.append(o_i)
            finals.append(s_i)
        o, final = torch.cat(outs, dim=1), torch.cat(finals, dim=0)
    return o.to(x.out_dtype), (final if output_final_state else None)
