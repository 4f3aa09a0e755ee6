"""Naive gated delta rule: the per-token loop, written as the recurrence reads (the truth for tests).

State orientation (the ops contract): S is [K, V] per value head, the write is S <- S + k u^T and
the read is o = S^T q. Per token, for every value head:

    S <- exp(g) S                      (decay; g = log decay <= 0, absent for the plain delta rule)
    u  = beta (v - S^T k)              (what the state does not yet predict for key k)
    S <- S + k u^T                     (the delta write: S <- (I - beta k k^T) S + beta k v^T)
    o  = S^T (scale q)

Computed in fp32 (fp64 when the inputs are fp64); value heads are grouped over key heads like GQA.
"""

from __future__ import annotations

import torch

from kvstate.ops._chunk_delta import normalize_qk, prepare
from kvstate.ops._common import repeat_heads


def naive_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (g may be None: no decay).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    batch = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=True)
    h, hv, dk, dv = batch.dims
    acc = batch.acc
    qf, kf = normalize_qk(batch.q, batch.k, acc, use_qk_l2norm_in_kernel)
    qf, kf = repeat_heads(qf * batch.scale, hv, dim=1), repeat_heads(kf, hv, dim=1)  # [tot, HV, K]
    vf, bf = batch.v.to(acc), batch.beta.to(acc)
    gf = None if batch.g is None else batch.g.to(acc)
    o = torch.empty_like(vf)
    finals = []
    for i, (start, n) in enumerate(zip(batch.starts, batch.lens)):
        s = torch.zeros(hv, dk, dv, dtype=acc, device=vf.device) if batch.s0 is None else batch.s0[i].to(acc)
        for t in range(start, start + n):
            if gf is not None:
                s = s * gf[t].exp()[:, None, None]
            u = bf[t][:, None] * (vf[t] - torch.einsum("hkv,hk->hv", s, kf[t]))
            s = s + kf[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        finals.append(s)
    final = torch.stack(finals) if finals else vf.new_zeros(0, hv, dk, dv)
    return o.to(batch.dtype).view(batch.out_shape), (final if output_final_state else None)
