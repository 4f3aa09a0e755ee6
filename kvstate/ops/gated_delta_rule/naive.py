"""Naive gated delta rule: the per-token loop, written as the recurrence reads (the truth for tests).

State orientation (the ops contract): S is [K, V] per value head, the write is S <- S + k u^T and
the read is o = S^T q. Per token, for every value head:

    S <- exp(g) S                      (decay; g = log decay <= 0, absent for the plain delta rule)
    u  = beta (v - S^T k)              (what the state does not yet predict for key k)
    S <- S + k u^T                     (the delta write: S <- (I - beta k k^T) S + beta k v^T)
    o  = S^T (scale q)

Computed in fp32 (fp64 when an input is fp64). Value head j reads key head j // (HV / H) (grouped
like GQA). The scale (K^-0.5 unless given), the optional L2 norm of q and k (x / sqrt(sum x^2 +
1e-6), as fla and transformers) and the grouping are written out here, from the formula: the
fast forms share `_inputs.prepare` and `_common`, and a reference that borrowed them would share
their bugs. Only the argument checks come from `prepare`.
"""

from __future__ import annotations

import torch

from kvstate.ops._inputs import prepare

L2_EPS = 1e-6


def naive_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV] (g may be None: no decay).

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens, needs_beta=True)
    return naive_recurrence(q, k, v, g, beta, scale=scale, l2=use_qk_l2norm_in_kernel, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def naive_recurrence(q, k, v, g, beta, *, scale, l2: bool, initial_state, output_final_state: bool, cu_seqlens):
    """The per-token loop of every q/k/v op (inputs already checked): the delta write when `beta` is
    given, else the plain write S <- S + k v^T (linear attention); g per value head [B, T, HV] or per
    channel [B, T, HV, K] (KDA), or None.

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] or None).
    """
    b, t, h, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    acc = torch.float64 if any(x is not None and x.dtype == torch.float64 for x in (q, k, v, g, beta)) \
        else torch.float32
    scale = dk**-0.5 if scale is None else float(scale)
    tokens = lambda x: None if x is None else x.to(acc).reshape(b * t, *x.shape[2:])  # noqa: E731
    qf, kf, vf, gf, bf = map(tokens, (q, k, v, g, beta))  # q, k [tot, H, K]; v [tot, HV, V]
    if l2:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + L2_EPS)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + L2_EPS)
    key_head = torch.arange(hv, device=q.device) // (hv // h)  # [HV]: the key head each value head reads
    qf, kf = scale * qf[:, key_head], kf[:, key_head]  # [tot, HV, K]
    if cu_seqlens is None:
        bounds = [(i * t, (i + 1) * t) for i in range(b)]
    else:
        cu = cu_seqlens.tolist()
        bounds = list(zip(cu[:-1], cu[1:]))
    o = torch.zeros_like(vf)
    finals = []
    for i, (start, end) in enumerate(bounds):
        s = torch.zeros(hv, dk, dv, dtype=acc, device=q.device) if initial_state is None else initial_state[i].to(acc)
        for j in range(start, end):
            if gf is not None:  # [HV] per head, [HV, K] per key channel
                s = s * gf[j].exp().reshape(hv, -1, 1)
            w = vf[j] if bf is None else bf[j][:, None] * (vf[j] - torch.einsum("hkv,hk->hv", s, kf[j]))
            s = s + kf[j][:, :, None] * w[:, None, :]
            o[j] = torch.einsum("hkv,hk->hv", s, qf[j])
        finals.append(s)
    final = torch.stack(finals) if finals else vf.new_zeros(0, hv, dk, dv)
    return o.to(q.dtype).view(b, t, hv, dv), (final if output_final_state else None)
