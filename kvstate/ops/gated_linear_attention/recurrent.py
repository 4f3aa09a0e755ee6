"""Recurrent gated linear attention (decode): S <- e^g S + k v^T, o = S^T (scale q), per token.

Three batched ops per token on a cached state block (decay, rank-1 write, read). See
kvstate/ops/_recurrent_delta.py for the state API (in-place pool updates, all intermediate states).
"""

from __future__ import annotations

import torch

from kvstate.ops import _recurrent_delta as drv
from kvstate.ops._common import repeat_heads
from kvstate.ops._inputs import prepare


def recurrent_gated_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                                     inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (log decay <= 0) or None.

    Returns (o, final_state) or, with output_all_states, (o, final_state, all_states [B, T, HV, K, V]).
    """
    flat = prepare(q, k, v, g, None, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=False, pool=state_indices is not None)

    def build(qf, kf):  # [tot, H, K]: normalized, q scaled
        h, hv, dk, dv = flat.dims
        acc = flat.acc
        # per (token, value head) row: scaled q [rows, 1, K], k [rows, K, 1], v [rows, 1, V]
        qs = repeat_heads(qf, hv, dim=1).reshape(-1, 1, dk)
        kc = repeat_heads(kf, hv, dim=1).reshape(-1, dk, 1)
        vr = flat.v.to(acc).reshape(-1, 1, dv)
        a = None if flat.g is None else flat.g.to(acc).exp().reshape(-1, 1, 1)  # [rows, 1, 1]
        o = torch.empty(qs.shape[0], 1, dv, dtype=acc, device=qs.device)

        def step(r0, r1, s_in, s_out):
            r = slice(r0, r1)
            if a is not None:
                torch.mul(s_in, a[r], out=s_out)
            elif s_out is not s_in:
                s_out.copy_(s_in)
            s_out.baddbmm_(kc[r], vr[r])  # + k v^T
            torch.bmm(qs[r], s_out, out=o[r])  # S^T q

        return step, o

    return drv.run(flat, build, l2=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
                   output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                   state_indices=state_indices)
