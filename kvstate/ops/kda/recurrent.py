"""KDA, the recurrent form: decode one or a few tokens per sequence, each state block read once.

One token per value head, with e = exp(g) and the old state S:

    [S^T (e k), S^T (e q)] = S^T [e k, e q]        one batched matmul reads S
    u = beta (v - S^T (e k))                       the delta against the decayed state
    o = S^T (e q) + (k . q) u                      = S_new^T q without reading S_new
    S_new = diag(e) S + k u^T                      one multiply into the destination, one rank-1 update

Decode is memory-bound, so the state is walked a block at a time (up to BLOCK_BYTES of heads of
one sequence) and every token of the call runs on that block while it sits in cache: DRAM sees
about one read and one write of each state. Packed batches (cu_seqlens) need no padding.

State API, the same as the delta family's recurrent forms (kvstate/ops/_recurrent_delta.py):
- `initial_state` [P, HV, K, V]; row `state_indices[n]` (default n) is sequence n's state.
- `inplace_final_state=True` updates those rows of `initial_state` in place (a contiguous tensor
  of the compute dtype, fp32) and returns it as the final state: no new state, no copy.
- `output_all_states=True` also returns the state after every token, [B, T, HV, K, V] (packed:
  [1, sum T, ...]), so the engine can roll back rejected speculative tokens.
Recurrent forms are inference kernels: no autograd (the chunk form is differentiable).
"""

from __future__ import annotations

import torch

from kvstate.ops._common import check_state_args
from kvstate.ops.kda._args import prepare

BLOCK_BYTES = 2 << 20  # state bytes per block: about one core's share of cache


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, output_all_states=False,
                  inplace_final_state=False, state_indices=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (log-decay); beta [B, T, HV].

    Returns (o, final_state) or, with output_all_states, (o, final_state, all_states).
    final_state is None unless output_final_state or inplace_final_state (then it is initial_state).
    """
    x = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                pool=state_indices is not None)
    check_state_args(x.num_seqs, x.dtype, initial_state, state_indices, inplace_final_state, q, k, v, g, beta,
                     initial_state)
    b, t, hv, dv = x.v.shape
    dk = x.g.shape[-1]
    h = x.q.shape[2]
    qn, kn = x.qk(x.q.reshape(b * t, h, dk), x.k.reshape(b * t, h, dk))  # [tot, HV, K]
    e = x.g.reshape(b * t, hv, dk).exp()
    ekq = torch.stack([e * kn, e * qn], dim=2)  # [tot, HV, 2, K]: e k and e q
    kdq = (kn * qn).sum(-1, keepdim=True)  # [tot, HV, 1]: k . q
    bt = x.beta.reshape(b * t, hv, 1)
    bv = x.v.reshape(b * t, hv, dv) * bt  # [tot, HV, V]
    e, kn = e.unsqueeze(-1), kn.unsqueeze(-1)  # [tot, HV, K, 1]
    o = x.v.new_empty(b * t, hv, dv)
    if cu_seqlens is None:
        starts, lens = [i * t for i in range(b)], [t] * b
    else:
        bounds = cu_seqlens.tolist()
        starts, lens = bounds[:-1], [z - a for a, z in zip(bounds[:-1], bounds[1:])]
    src = initial_state  # [P, HV, K, V] (rows go to the compute dtype block by block), or None (zeros)
    rows = list(range(x.num_seqs)) if state_indices is None else state_indices.tolist()
    nb = max(1, min(hv, BLOCK_BYTES // (dk * dv * x.v.element_size())))  # heads per block
    if inplace_final_state:
        final = initial_state
    elif output_final_state:
        final = x.v.new_empty(x.num_seqs, hv, dk, dv)
    else:
        final, scratch = None, x.v.new_empty(nb, dk, dv)
    states = x.v.new_empty(b * t, hv, dk, dv) if output_all_states else None
    for n, (start, length) in enumerate(zip(starts, lens)):
        for h0 in range(0, hv, nb):
            hs = slice(h0, min(hv, h0 + nb))
            s = None if src is None else src[rows[n], hs].to(x.dtype)  # [nb, K, V]
            dst = s if inplace_final_state else (scratch[: hs.stop - h0] if final is None else final[n, hs])
            for i in range(start, start + length):
                s_out = dst if states is None else states[i, hs]  # the first token reads s, writes s_out
                if s is None:
                    s = s_out.zero_()
                m = torch.bmm(ekq[i, hs], s)  # [nb, 2, V]: S^T (e k), S^T (e q)
                u = torch.addcmul(bv[i, hs], bt[i, hs], m[:, 0], value=-1)  # beta (v - S^T (e k))
                torch.addcmul(m[:, 1], kdq[i, hs], u, out=o[i, hs])
                torch.mul(s, e[i, hs], out=s_out)  # decay (s_out may be s: in place)
                s_out.baddbmm_(kn[i, hs], u.unsqueeze(1))  # + k u^T
                s = s_out
            if dst is not s:  # an empty sequence, or the last state went to all_states
                dst.zero_() if s is None else dst.copy_(s)
    out = (o.view(b, t, hv, dv).to(x.out_dtype), final)
    return out + (states.view(b, t, hv, dk, dv),) if output_all_states else out
