"""Recurrent gated delta rule (decode): one or a few tokens per sequence, state updated per token.

One pass over each cached state block per token, using the identity (S' = e^g S the decayed state)

    S'^T k and S'^T q in one batched matmul,  u = beta (v - S'^T k),
    o = S'^T q + (k . q) u,                   S <- S' + k u^T

so the read of the new state for the output needs no second pass. See kvstate/ops/_recurrent_delta.py
for the state API (in-place updates of a state pool by index, all intermediate states).
"""

from __future__ import annotations

import torch

from kvstate.ops import _recurrent_delta as drv
from kvstate.ops._common import repeat_heads
from kvstate.ops._inputs import prepare


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                               inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay <= 0, or None), beta [B, T, HV].

    Returns (o, final_state) or, with output_all_states, (o, final_state, all_states [B, T, HV, K, V]).
    final_state is None unless output_final_state or inplace_final_state (then it is initial_state).
    """
    flat = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=True, pool=state_indices is not None)

    def build(qf, kf):  # [tot, H, K]: normalized, q scaled
        h, hv, dk, dv = flat.dims
        acc = flat.acc
        # per (token, value head) row: k and scaled q [rows, 2, K], k . q [rows, 1]
        kq = repeat_heads(torch.stack([kf, qf], dim=2), hv, dim=1).flatten(0, 1)
        kdq = repeat_heads((kf * qf).sum(-1), hv, dim=1).reshape(-1, 1)
        bt = flat.beta.to(acc).reshape(-1, 1)  # [rows, 1]
        bv = flat.v.to(acc).flatten(0, 1) * bt  # [rows, V]
        a = None if flat.g is None else flat.g.to(acc).exp().reshape(-1, 1, 1)  # [rows, 1, 1]
        o = torch.empty(kq.shape[0], dv, dtype=acc, device=kq.device)

        def step(r0, r1, s_in, s_out):
            r = slice(r0, r1)
            if a is not None:
                torch.mul(s_in, a[r], out=s_out)  # decay first
            elif s_out is not s_in:
                s_out.copy_(s_in)
            m = torch.bmm(kq[r], s_out)  # [rows, 2, V]: S'^T k, S'^T q
            u = torch.addcmul(bv[r], bt[r], m[:, 0], value=-1)  # beta (v - S'^T k)
            torch.addcmul(m[:, 1], kdq[r], u, out=o[r])  # S_new^T q
            s_out.baddbmm_(kq[r, 0].unsqueeze(-1), u.unsqueeze(1))  # S' + k u^T

        return step, o

    return drv.run(flat, build, l2=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
                   output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                   state_indices=state_indices)
