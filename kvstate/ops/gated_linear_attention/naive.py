"""Naive gated linear attention with one scalar log decay per value head (the Mamba-2 / SSD form).

Per token, for every value head (state S [K, V], the ops contract's orientation):

    S <- exp(g) S + k v^T        (g = log decay <= 0; absent for plain linear attention)
    o  = S^T (scale q)

The per-token loop, written as the recurrence reads: the truth the chunk and recurrent forms are
tested against. fp32 (fp64 for fp64 inputs); value heads grouped over key heads like GQA.
"""

from __future__ import annotations

import torch

from kvstate.ops._chunk_delta import normalize_qk, prepare
from kvstate.ops._common import repeat_heads


def naive_gated_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] or None.

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    batch = prepare(q, k, v, g, None, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=False)
    h, hv, dk, dv = batch.dims
    acc = batch.acc
    qf, kf = normalize_qk(batch.q, batch.k, acc, use_qk_l2norm_in_kernel)
    qf, kf = repeat_heads(qf * batch.scale, hv, dim=1), repeat_heads(kf, hv, dim=1)  # [tot, HV, K]
    vf = batch.v.to(acc)
    gf = None if batch.g is None else batch.g.to(acc)
    o = torch.empty_like(vf)
    finals = []
    for i, (start, n) in enumerate(zip(batch.starts, batch.lens)):
        s = torch.zeros(hv, dk, dv, dtype=acc, device=vf.device) if batch.s0 is None else batch.s0[i].to(acc)
        for t in range(start, start + n):
            if gf is not None:
                s = s * gf[t].exp()[:, None, None]
            s = s + kf[t][:, :, None] * vf[t][:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        finals.append(s)
    final = torch.stack(finals) if finals else vf.new_zeros(0, hv, dk, dv)
    return o.to(batch.dtype).view(batch.out_shape), (final if output_final_state else None)
