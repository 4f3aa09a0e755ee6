"""Chunked gated linear attention with a scalar log decay per value head (also linear attention, SSD).

Per value head, inside a chunk of C tokens with cumulative log decay b_t = g_1 + ... + g_t and the
state entering the chunk S0 (the SSD "dual" form of Mamba-2):

    O   = diag(e^b) Q S0 + (Q K^T o Gamma) V,       Gamma_tj = e^{b_t - b_j} for j <= t, else 0
    S_C = e^{b_C} S0 + (K o e^{b_C - b})^T V

The chunk-local terms (Q K^T per key head, the decay masks, decayed q and k) are batched over a
block of chunks; the sequential loop over chunks reads the entering state once per chunk (the
inter-chunk output), adds the intra-chunk output and updates the state in place. With g None
(plain linear attention) all decays vanish and Q K^T's causal mask is shared by a group's heads.
"""

from __future__ import annotations

import torch

from kvstate.ops._chunk_delta import ChunkScan, capture_plan, decay_mask, partial_state, run_at
from kvstate.ops._inputs import FlatInputs, prepare

BLOCK_BYTES = 4 << 20  # target size of one [slots, HV, C, max(K, V)] temporary in a block


def chunk_gated_linear_attention(q, k, v, g=None, *, scale=None, initial_state=None, output_final_state=False,
                                 use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=32, state_positions=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV] (log decay <= 0) or None.

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None); with
    `state_positions` (inference), also the states after those token counts of each sequence, from
    the same scan (as chunk_gated_delta_rule).
    """
    flat = prepare(q, k, v, g, None, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=False)
    return run_at(flat, chunk_gla, state_positions, output_final_state=output_final_state,
                  l2=use_qk_l2norm_in_kernel, chunk_size=chunk_size)


def chunk_gla(flat: FlatInputs, o_dst, s_dst, output_final_state: bool, *, l2: bool, chunk_size: int, grad: bool,
              captures: list | None = None, c_dst=None):
    """The kernel behind chunk_gated_linear_attention, chunk_linear_attention and chunk_ssd.

    Writes into o_dst [tot, HV, V] / s_dst [N, HV, K, V] when given; returns (o [tot, HV, V], final or None).
    `captures` [(sequence, p)]: the state after the sequence's first p tokens goes to c_dst[index].
    """
    scan = ChunkScan(flat, chunk_size, grad, o_dst, s_dst)
    h, hv, dk, dv = flat.dims
    grp, c, out = hv // h, chunk_size, scan.out
    at = capture_plan(scan.lay, captures)  # first slot of a step -> [(rank, offset in the chunk, index)]
    for s0, n, steps, qc, kc, vc in scan.blocks(BLOCK_BYTES, l2):
        qk = (qc @ kc.transpose(-1, -2)).unsqueeze(2)  # [n, H, 1, C, C], shared by the group
        if flat.g is None:
            attn = (qk * flat.scale).tril().expand(n, h, grp, c, c)
            qd = (qc * flat.scale).unsqueeze(2).expand(n, h, grp, c, dk)
            kd, dec = kc.unsqueeze(2).expand(n, h, grp, c, dk), None
        else:
            b = scan.gather(flat.g, s0, n).view(n, h, grp, c).cumsum(-1)  # cumulative log decay
            eb = b.exp()
            attn = (qk * flat.scale) * decay_mask(b)  # [n, H, G, C, C]
            qd = qc.unsqueeze(2) * (eb * flat.scale).unsqueeze(-1)  # [n, H, G, C, K]
            kd = kc.unsqueeze(2) * (b[..., -1:] - b).exp().unsqueeze(-1)  # keys decayed to the chunk end
            dec = eb[..., -1].reshape(n, hv, 1, 1)  # decay over the whole chunk

        def step(r, m, state, qd, kd, vc, attn, dec, kb, bb):  # this step's rows of the block tensors
            mat = lambda x, d: x.reshape(m * hv, c, d)  # noqa: E731  [m HV, C, d] per-head matrices
            s = state.view(m * hv, dk, dv)
            vr, kd_t = mat(vc, dv), mat(kd, dk).transpose(1, 2)
            for rank, off, index in at.get(s0 + r, ()):  # states inside this chunk, before s moves on
                c_dst[index] = partial_state(state[rank], kb[rank], None if bb is None else bb[rank],
                                             vr.view(m, hv, c, dv)[rank], off, grp)
            dec = None if dec is None else dec.reshape(m * hv, 1, 1)
            target = out.target(s0 + r, m)
            # inter-chunk (the state entering the chunk, read by q), then intra-chunk
            o = torch.bmm(mat(qd, dk), s) if target is None else torch.bmm(mat(qd, dk), s, out=target)
            o = torch.baddbmm(o, mat(attn, c), vr) if grad else o.baddbmm_(mat(attn, c), vr)
            if target is None:
                out.put(s0 + r, o.view(m, hv, c, dv))
            if grad:  # S_C = e^{b_C} S0 + (K o e^{b_C - b})^T V, out-of-place
                return torch.baddbmm(s if dec is None else s * dec, kd_t, vr).view(m, hv, dk, dv)
            if dec is not None:
                s.mul_(dec)
            s.baddbmm_(kd_t, vr)

        kb = kc if at else None  # keys [n, H, C, K] and cumulative log decays [n, H, G, C], for captures
        bb = None if not at or flat.g is None else b
        scan.carry.run(s0, steps, step, qd, kd, vc, attn, dec, kb, bb)
    return scan.result(output_final_state)
