"""KDA, the recurrent form: decode one or a few tokens per sequence, each state block read once.

One token per value head, with e = exp(g) and the old state S:

    [S^T (e k), S^T (e q)] = S^T [e k, e q]        one batched matmul reads S
    u = beta (v - S^T (e k))                       the delta against the decayed state
    o = S^T (e q) + (k . q) u                      = S_new^T q without reading S_new
    S_new = diag(e) S + k u^T                      one multiply into the destination, one rank-1 update

Decode is memory-bound: this is one `step` of the shared decode driver
(kvstate/ops/_recurrent_delta.py), which walks the state in cache-sized blocks, runs every token
of the call on a block while it sits in cache, and spreads big calls over worker threads. Its
state API is every recurrent form's:
- `initial_state` [P, HV, K, V]; row `state_indices[n]` (default n) is sequence n's state.
- `inplace_final_state=True` updates those rows of `initial_state` in place (a contiguous tensor
  of the compute dtype, fp32) and returns it as the final state: no new state, no copy.
- `output_all_states=True` also returns the state after every token, [B, T, HV, K, V] (packed:
  [1, sum T, ...]), so the engine can roll back rejected speculative tokens.
Recurrent forms are inference kernels: no autograd (the chunk form is differentiable).
"""

from __future__ import annotations

import torch

from kvstate.ops import _recurrent_delta as drv
from kvstate.ops._common import repeat_heads
from kvstate.ops._inputs import prepare


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                  inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay); beta [B, T, HV].

    Returns (o, final_state) or, with output_all_states, (o, final_state, all_states).
    final_state is None unless output_final_state or inplace_final_state (then it is initial_state).
    """
    flat = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=True, g_shape="channel", pool=state_indices is not None)

    def build(qf, kf):  # [tot, H, K]: normalized, q scaled
        h, hv, dk, dv = flat.dims
        acc = flat.acc
        qn, kn = repeat_heads(qf, hv, dim=1).flatten(0, 1), repeat_heads(kf, hv, dim=1).flatten(0, 1)  # [rows, K]
        e = flat.g.to(acc).flatten(0, 1).exp()  # [rows, K]
        ekq = torch.stack([e * kn, e * qn], dim=1)  # [rows, 2, K]: e k and e q
        kdq = (kn * qn).sum(-1, keepdim=True)  # [rows, 1]: k . q
        bt = flat.beta.to(acc).reshape(-1, 1)  # [rows, 1]
        bv = flat.v.to(acc).flatten(0, 1) * bt  # [rows, V]
        e, kn = e.unsqueeze(-1), kn.unsqueeze(-1)  # [rows, K, 1]
        o = torch.empty(bv.shape[0], dv, dtype=acc, device=bv.device)

        def step(r0, r1, s_in, s_out):
            r = slice(r0, r1)
            s_in = s_in.to(acc)  # a state pool of another dtype: this block's rows only
            m = torch.bmm(ekq[r], s_in)  # [rows, 2, V]: S^T (e k), S^T (e q)
            u = torch.addcmul(bv[r], bt[r], m[:, 0], value=-1)  # beta (v - S^T (e k))
            torch.addcmul(m[:, 1], kdq[r], u, out=o[r])  # = S_new^T q
            torch.mul(s_in, e[r], out=s_out)  # decay (s_out may be s_in: in place)
            s_out.baddbmm_(kn[r], u.unsqueeze(1))  # + k u^T

        return step, o

    return drv.run(flat, build, l2=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
                   output_all_states=output_all_states, inplace_final_state=inplace_final_state,
                   state_indices=state_indices)
