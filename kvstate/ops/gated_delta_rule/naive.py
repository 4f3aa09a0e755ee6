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

from kvstate.ops._common import repeat_heads
from kvstate.ops._inputs import FlatInputs, normalize_qk, prepare


def naive_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (g may be None: no decay).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    flat = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=True)
    return naive_recurrence(flat, l2=use_qk_l2norm_in_kernel, output_final_state=output_final_state)


def naive_recurrence(flat: FlatInputs, *, l2: bool, output_final_state: bool):
    """The per-token loop of every q/k/v op: the delta write when flat.beta is given, else the plain
    write S <- S + k v^T (linear attention); g per value head [tot, HV] or per channel [tot, HV, K] (KDA).

    Returns (o [B, T, HV, V] in the input dtype, final_state [N, HV, K, V] or None).
    """
    h, hv, dk, dv = flat.dims
    acc = flat.acc
    qf, kf = normalize_qk(flat.q, flat.k, acc, l2, scale=flat.scale)
    qf, kf = repeat_heads(qf, hv, dim=1), repeat_heads(kf, hv, dim=1)  # [tot, HV, K]
    vf = flat.v.to(acc)
    bf = None if flat.beta is None else flat.beta.to(acc)
    decay = None  # of the state rows: [tot, HV, 1, 1] per head, [tot, HV, K, 1] per channel
    if flat.g is not None:
        decay = flat.g.to(acc).exp().reshape(vf.shape[0], hv, dk if flat.g.dim() == 3 else 1, 1)
    o = torch.empty_like(vf)
    finals = []
    for i, (start, n) in enumerate(zip(flat.starts, flat.lens)):
        s = torch.zeros(hv, dk, dv, dtype=acc, device=vf.device) if flat.s0 is None else flat.s0[i].to(acc)
        for t in range(start, start + n):
            if decay is not None:
                s = s * decay[t]
            w = vf[t] if bf is None else bf[t][:, None] * (vf[t] - torch.einsum("hkv,hk->hv", s, kf[t]))
            s = s + kf[t][:, :, None] * w[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, qf[t])
        finals.append(s)
    final = torch.stack(finals) if finals else vf.new_zeros(0, hv, dk, dv)
    return o.to(flat.dtype).view(flat.out_shape), (final if output_final_state else None)
