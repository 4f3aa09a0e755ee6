"""Chunked gated delta rule (prefill/training): the WY/UT form, batched over chunks and heads.

Per value head, inside a chunk of C tokens with cumulative log decay b_t = g_1 + ... + g_t, the
state entering the chunk S0, and u_t = beta_t (v_t - S'_t^T k_t) the delta actually written
(S'_t the decayed state just before token t's write):

    S_t   = e^{b_t} S0 + sum_{j<=t} e^{b_t - b_j} k_j u_j^T
    (I + L) U = diag(beta) V - diag(beta e^b) K S0,  L_tj = beta_t e^{b_t - b_j} (k_t . k_j), j < t
    U     = u - w S0,  with  [w | u] = (I + L)^{-1} [diag(beta e^b) K | diag(beta) V]
    O     = diag(e^b) Q S0 + (Q K^T o Gamma) U,      Gamma_tj = e^{b_t - b_j} for j <= t
    S_C   = e^{b_C} S0 + (K o e^{b_C - b})^T U

Everything that does not depend on S0 (q k^T and k k^T per key head, the decay masks, one
triangular inverse per chunk, w and u) is computed for a block of chunks at once in batched
matmuls. The sequential loop over chunks then does, per chunk: one matmul [w; q] S0 (both reads
of the entering state at once), the intra-chunk (Q K^T o Gamma) U, and the in-place state update;
the outputs go straight into the token-major result. Chunks are processed a block at a time so
that temporaries stay a few MiB: fresh large allocations cost page faults that would otherwise
dominate on CPU. Key/query heads are never repeated for grouped value heads: k k^T, q k^T and
w = (I + L)^-1 diag(beta e^b) K are computed once per key head and broadcast or stacked.
"""

from __future__ import annotations

import torch

from kvstate.ops._chunk_delta import ChunkScan, capture_plan, decay_mask, partial_state, run_at
from kvstate.ops._inputs import FlatInputs, prepare

BLOCK_BYTES = 4 << 20  # target size of one [slots, HV, C, max(K, V)] temporary in a block


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=32, state_positions=None):
    """Gated delta rule, chunked. q, k [B, T, H, K]; v [B, T, HV, V]; g (log decay <= 0), beta [B, T, HV].

    Returns (o [B, T, HV, V] in q's dtype, final_state [N, HV, K, V] fp32 or None). Any chunk_size
    works; 32 is the fastest on CPU (fla's GPU kernels use 64) and keeps the triangular systems small.
    `state_positions` (inference only): per sequence, token counts 0 < p < its length after which its
    state is wanted; then also returns them, per sequence a list of [HV, K, V], from the same scan
    (at a chunk boundary the carried state; inside a chunk a partial step from the one before it).
    """
    flat = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                    needs_beta=True)
    return run_at(flat, chunk_delta, state_positions, output_final_state=output_final_state,
                  l2=use_qk_l2norm_in_kernel, chunk_size=chunk_size)


def chunk_delta(flat: FlatInputs, o_dst, s_dst, output_final_state: bool, *, l2: bool, chunk_size: int, grad: bool,
                captures: list | None = None, c_dst=None):
    """The kernel behind chunk_gated_delta_rule and chunk_delta_rule (flat.g None: no decay).

    Writes into o_dst [tot, HV, V] / s_dst [N, HV, K, V] when given; returns (o [tot, HV, V], final or None).
    `captures` [(sequence, p)]: the state after the sequence's first p tokens goes to c_dst[index] [HV, K, V].
    """
    scan = ChunkScan(flat, chunk_size, grad, o_dst, s_dst)
    h, hv, dk, dv = flat.dims
    grp, c, acc, out = hv // h, chunk_size, flat.acc, scan.out
    at = capture_plan(scan.lay, captures)  # first slot of a step -> [(rank, offset in the chunk, index)]
    eye = torch.eye(c, dtype=acc, device=flat.q.device)
    for s0, n, steps, qc, kc, vc in scan.blocks(BLOCK_BYTES, l2):
        bt = scan.gather(flat.beta, s0, n).view(n, h, grp, c)
        qk = (qc @ kc.transpose(-1, -2)).unsqueeze(2)  # [n, H, 1, C, C], shared by the group
        kk = (kc @ kc.transpose(-1, -2)).unsqueeze(2)
        if flat.g is None:
            # L_tj = beta_t k_t.k_j; only its strict lower triangle is read by the unit-triangular solve
            tinv = torch.linalg.solve_triangular(kk * bt.unsqueeze(-1), eye, upper=False, unitriangular=True)
            tk = tv = tinv * bt.unsqueeze(-2)  # (I + L)^-1 diag(beta): [n, H, G, C, C]
            attn = (qk * flat.scale).tril().expand(n, h, grp, c, c)
            qd = (qc * flat.scale).unsqueeze(2).expand(n, h, grp, c, dk)
            kd, dec = kc.unsqueeze(2).expand(n, h, grp, c, dk), None
        else:
            b = scan.gather(flat.g, s0, n).view(n, h, grp, c).cumsum(-1)  # cumulative log decay
            gam = decay_mask(b)  # [n, H, G, C, C]
            eb = b.exp()
            tinv = torch.linalg.solve_triangular(kk * gam * bt.unsqueeze(-1), eye, upper=False, unitriangular=True)
            tv = tinv * bt.unsqueeze(-2)
            tk = tv * eb.unsqueeze(-2)  # (I + L)^-1 diag(beta e^b)
            attn = (qk * flat.scale) * gam
            qd = qc.unsqueeze(2) * (eb * flat.scale).unsqueeze(-1)  # [n, H, G, C, K]
            kd = kc.unsqueeze(2) * (b[..., -1:] - b).exp().unsqueeze(-1)  # keys decayed to the chunk end
            dec = eb[..., -1].reshape(n, hv, 1, 1)  # decay over the whole chunk
        u = tv @ vc  # [n, H, G, C, V]
        # w = (I + L)^-1 diag(beta e^b) K; stacked over q so that one matmul per chunk reads the state
        w = (tk.reshape(n * h, grp * c, c) @ kc.view(n * h, c, dk)).view(n, h, grp, c, dk)  # k shared by the group
        wq = torch.cat([w, qd], dim=-2)  # [n, H, G, 2C, K]

        def step(r, m, state, wq, u, kd, attn, dec, kb, bb):  # this step's rows of the block tensors
            mat = lambda x, d, rr=c: x.reshape(m * hv, rr, d)  # noqa: E731  [m HV, rr, d] per head
            s = state.view(m * hv, dk, dv)
            ws = torch.bmm(mat(wq, dk, 2 * c), s)  # [m HV, 2C, V]: w S and q S
            vn = mat(u, dv) - ws[:, :c]  # u - w S: the deltas written
            for rank, off, index in at.get(s0 + r, ()):  # states inside this chunk, before s moves on
                c_dst[index] = partial_state(state[rank], kb[rank], None if bb is None else bb[rank],
                                             vn.view(m, hv, c, dv)[rank], off, grp)
            kd_t = mat(kd, dk).transpose(1, 2)
            dec = None if dec is None else dec.reshape(m * hv, 1, 1)
            if grad:  # autograd: out-of-place
                out.put(s0 + r, torch.baddbmm(ws[:, c:], mat(attn, c), vn).view(m, hv, c, dv))
                s_dec = s if dec is None else s * dec
                return torch.baddbmm(s_dec, kd_t, vn).view(m, hv, dk, dv)
            target = out.target(s0 + r, m)
            # inter-chunk (the state entering the chunk, read by q) plus intra-chunk
            o = torch.baddbmm(ws[:, c:], mat(attn, c), vn, **({} if target is None else {"out": target}))
            if target is None:
                out.put(s0 + r, o.view(m, hv, c, dv))
            if dec is not None:
                s.mul_(dec)
            s.baddbmm_(kd_t, vn)

        kb = kc if at else None  # keys [n, H, C, K] and cumulative log decays [n, H, G, C], for captures
        bb = None if not at or flat.g is None else b
        scan.carry.run(s0, steps, step, wq, u, kd, attn, dec, kb, bb)
    return scan.result(output_final_state)

