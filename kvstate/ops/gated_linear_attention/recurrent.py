"""Recurrent gated linear attention (decode): S <- e^g S + k v^T, o = S^T (scale q), per token.

Three batched ops per token on a cached state block (decay, rank-1 write, read). See
kvstate/ops/_recurrent_delta.py for the state API (in-place pool updates, all intermediate states).
"""

from __future__ import annotations

import torch

from kvstate.ops import _recurrent_delta as drv
from kvstate.ops._chunk_delta import Batch, normalize_qk, prepare
from kvstate.ops._common import check_state_args, repeat_heads


def recurrent_gated_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                                     inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (log decay <= 0) or None.

    Returns (o, final_state) or, with output_all_states, (o, final_state, all_states [B, T, HV, K, V]).
    """
    batch = prepare(q, k, v, g, None, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=False, pool=state_indices is not None)
    check_state_args(batch.n_seq, batch.acc, initial_state, state_indices, inplace_final_state, q, k, v, g, initial_state)
    return recurrent_gla(batch, l2=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
                         output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                         state_indices=state_indices)


def recurrent_gla(batch: Batch, *, l2: bool, output_final_state: bool, output_all_states: bool,
                  inplace_final_state: bool, state_indices):
    """The kernel behind recurrent_gated_linear_attention, recurrent_linear_attention and recurrent_ssd."""
    with drv.plan(batch, output_all_states, state_indices) as n_work:  # big calls: blocks over workers
        h, hv, dk, dv = batch.dims
        acc = batch.acc
        qf, kf = normalize_qk(batch.q, batch.k, acc, l2)
        # per (token, value head) row: scaled q [rows, 1, K], k [rows, K, 1], v [rows, 1, V]
        qs = repeat_heads(qf * batch.scale, hv, dim=1).reshape(-1, 1, dk)
        kc = repeat_heads(kf, hv, dim=1).reshape(-1, dk, 1)
        vr = batch.v.to(acc).reshape(-1, 1, dv)
        a = None if batch.g is None else batch.g.to(acc).exp().reshape(-1, 1, 1)  # [rows, 1, 1]
        o = torch.empty(qs.shape[0], 1, dv, dtype=acc, device=qs.device)

        def step(r0, r1, s_in, s_out):
            r = slice(r0, r1)
            if a is not None:
                torch.mul(s_in, a[r], out=s_out)
            elif s_out is not s_in:
                s_out.copy_(s_in)
            s_out.baddbmm_(kc[r], vr[r])  # + k v^T
            torch.bmm(qs[r], s_out, out=o[r])  # S^T q

        final, all_states = drv.run(batch, step, n_work=n_work, output_final_state=output_final_state,
                                    output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                                    state_indices=state_indices)
    out = (o.to(batch.dtype).view(batch.out_shape), final)
    return out + (all_states,) if output_all_states else out
