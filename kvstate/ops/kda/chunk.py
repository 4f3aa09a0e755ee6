"""KDA, the chunk form: prefill and training in matmuls, exact and stable in fp32.

Within a chunk of C tokens (G = cumulative log-decay from the chunk start, per channel, G <= 0,
non-increasing), with S0 the state entering the chunk, the per-token recurrence of naive.py is

    U = T (beta V) - T (beta K exp(G)) S0 = U0 - W S0     T = (I + A)^-1, A[i, j] = beta_i a(k_i, k_j)
    O = (Q exp(G)) S0 + P U                                P[i, j] = a(q_i, k_j), j <= i
    S_C = exp(G_C) S0 + (K exp(G_C - G))^T U

with a(x_i, y_j) = sum_k x_i[k] y_j[k] exp(G_i[k] - G_j[k]) (see intra.py for its stable matmul
form; T comes from solve.py). Everything except U and the chunk states depends only on the
inputs, so it is computed for a slab of chunks at once in batched matmuls; the sequential loop
over chunks is batched matmuls over the heads (U, the outputs, the next state).

Layout inside: one row per (chunk, value head), chunks step-major (kvstate/ops/_layout.py), [R, C, D]. A slab
is a few MiB of such rows, so its temporaries stay in cache and are reused by the allocator
(fresh pages of large temporaries cost more than the arithmetic on them).
"""

from __future__ import annotations

import torch

from kvstate.ops._chunk_delta import capture_plan, needs_grad, per_sequence
from kvstate.ops._inputs import FlatInputs, normalize_qk, prepare
from kvstate.ops._layout import ChunkLayout, chunk_layout
from kvstate.ops.kda.intra import SUB_CHUNK, intra_scores
from kvstate.ops.kda.solve import unit_lower_inverse


SLAB_ROWS = 4096  # token-heads per slab: [R, C, K] fp32 temporaries of 2 MiB at K = 128
# exp of any sum of g's that includes a g below this is 0 in fp32 and fp64 alike, so clamping g
# there changes nothing, and keeps -inf (a full reset) out of the matmuls (0 * -inf = nan)
G_FLOOR = -1e4


def _slab(q, k, v, g, beta, S, sizes, hv, at=(), c_dst=None):
    """A slab of consecutive steps. q, k, g [R, C, K], v [R, C, V], beta [R, C] with R = chunks x HV;
    S [rows, K, V] the state rows still running; sizes: (chunks, sequences running) per step; `at`:
    per step [(rank, offset o, index)], the state after the chunk's first o tokens -> c_dst[index].
    -> (o [R, C, V], S, states of the sequences that finished in this slab)."""
    r_, c, dk = k.shape
    sc = intra_scores(q, k, g)  # P, A [R, C, C]; factored q, k [R, n, sub, K]
    d = sc.d
    q_pre = (sc.q_loc * d.e_before).view(r_, c, dk)  # q exp(G_i)
    k_pre = (sc.k_loc * d.e_before).view(r_, c, dk)  # k exp(G_i)
    kd = (sc.k_tail * d.e_after).view(r_, c, dk).transpose(1, 2)  # [R, K, C]: k_j decayed to the chunk end
    decay = d.whole().unsqueeze(-1)  # [R, K, 1]
    T = unit_lower_inverse(sc.A * beta.unsqueeze(-1)) * beta.unsqueeze(-2)  # (I + beta A)^-1 diag(beta)
    W = torch.bmm(T, k_pre)  # [R, C, K]
    U0 = torch.bmm(T, v)  # [R, C, V]
    outs, done, r = [], [], 0
    for j, (chunks, running) in enumerate(sizes):
        if S.shape[0] > running * hv:  # sequences with no chunk left: their state is final
            done.append(S[running * hv :])
            S = S[: running * hv]
        rs = slice(r, r + chunks * hv)
        u = torch.baddbmm(U0[rs], W[rs], S, alpha=-1)  # [rows, C, V] = U0 - W S
        for rank, off, index in at[j] if at else ():  # states inside this chunk, before S moves on
            heads = slice(rank * hv, (rank + 1) * hv)
            rows = slice(r + rank * hv, r + (rank + 1) * hv)
            c_dst[index] = _partial(S[heads], k[rows], g[rows], u[heads], off)
        outs.append(torch.bmm(sc.P[rs], u).baddbmm_(q_pre[rs], S))  # P U + Q exp(G) S
        S = (S * decay[rs]).baddbmm_(kd[rs], u)  # [rows, K, V]: decayed, plus the chunk's writes
        r += chunks * hv
    return torch.cat(outs), S, done


def _partial(s: torch.Tensor, k: torch.Tensor, g: torch.Tensor, u: torch.Tensor, o: int) -> torch.Tensor:
    """The state after a chunk's first o tokens: s [HV, K, V] entering it, k, g [HV, C, K] its keys and
    log decays, u [HV, C, V] the deltas written. S_o = exp(G_o) s + sum_{t<o} (k_t exp(G_o - G_t)) u_t^T."""
    if o == 0:
        return s.clone()
    cum = g[:, :o].cumsum(1)  # [HV, o, K]
    last = cum[:, -1:]  # [HV, 1, K]
    kd = k[:, :o] * (last - cum).exp()  # keys decayed to token o
    return torch.baddbmm(s * last.transpose(1, 2).exp(), kd.transpose(1, 2), u[:, :o])


def _forward(x: FlatInputs, lay: ChunkLayout, v, g, beta, state, *, l2: bool, grad: bool, floor: bool,
             captures: list | None = None, c_dst=None):
    """x: the flat inputs (raw q, k [tot, H, K]); v [tot, HV, V], g [tot, HV, K], beta [tot, HV] and
    state [N, HV, K, V] in the compute dtype -> (o [tot, HV, V], final state [N, HV, K, V]).
    floor: clamp g at G_FLOOR (some g is below it, maybe -inf)."""
    tot, hv, dk = g.shape
    dv, c = v.shape[-1], lay.chunk
    o = v.new_empty(tot + 1, hv, dv)  # row `tot` takes the padding positions
    S = lay.by_rank(state).reshape(-1, dk, dv)  # [N * HV, K, V], rows in scan order
    heads = torch.arange(hv, device=v.device)[None, :, None]  # [1, HV, 1]
    kheads = heads // (hv // x.q.shape[1])  # the key head serving each value head
    done = []
    plan = capture_plan(lay, captures)  # first slot of a step -> [(rank, offset, index)]
    for s0, s1, steps in lay.blocks(hv * c, SLAB_ROWS):  # a slab: steps of about SLAB_ROWS token-heads
        tok, valid = lay.tok[s0:s1, None, :], lay.valid[s0:s1, None, :]  # [chunks, 1, C]
        # gathers straight into [chunks, HV, C, D] (key heads repeated on the way): fresh tensors
        qs, ks = normalize_qk(x.q[tok, kheads], x.k[tok, kheads], x.acc, l2, inplace=not grad, scale=x.scale)
        gs, bs = g[tok, heads], beta[tok, heads]
        if floor:
            gs = gs.clamp(min=G_FLOOR)
        if not bool(valid.all()):  # padding positions: g = 0, beta = 0 leave the state unchanged
            gs, bs = gs * valid[..., None], bs * valid
        sizes = [(m, m) for _, m, _ in steps]  # each running sequence has one chunk per step
        ys = (y.flatten(0, 1) for y in (qs, ks, v[tok, heads], gs, bs))  # [chunks * HV, C, *D]
        at = [plan.get(first, []) for first, _, _ in steps] if plan else ()
        o_slab, S, finished = _slab(*ys, S, sizes, hv, at, c_dst)
        done += finished
        o.index_put_((torch.where(valid, tok, tot), heads), o_slab.view(-1, hv, c, dv))
    final = torch.cat([S] + done[::-1]) if lay.steps else S.clone()  # rows in scan order (never the input)
    return o[:tot], lay.by_sequence(final.view(-1, hv, dk, dv))


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, state_positions=None):
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (<= 0); beta [B, T, HV] -> (o, state).

    Same results as naive_kda. chunk_size: 16, 32, 64 (default), 128, ... Sequences of a packed
    batch (cu_seqlens) cost their own length: no padding to the longest. `state_positions`
    (inference): per sequence, token counts 0 < p < its length; then also returns the states
    there, per sequence a list of [HV, K, V], from the same scan (a partial step inside a chunk).
    """
    n_sub = chunk_size // SUB_CHUNK if isinstance(chunk_size, int) else 0
    if n_sub <= 0 or n_sub * SUB_CHUNK != chunk_size or n_sub & (n_sub - 1):
        raise ValueError(f"chunk_size must be {SUB_CHUNK} times a power of two, got {chunk_size}")
    x = prepare(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens,
                needs_beta=True, g_shape="channel")
    acc, (_, hv, dk, dv) = x.acc, x.dims
    gf = x.g.to(acc)
    lowest, highest = torch.aminmax(gf) if gf.numel() else (0.0, 0.0)
    if highest > 0:
        raise ValueError("g must be <= 0 (a log-decay)")
    state = x.v.new_zeros(x.n_seq, hv, dk, dv, dtype=acc) if x.s0 is None else x.s0.to(acc)
    lay = chunk_layout(x.lens, x.starts, chunk_size, x.v.device)
    grad = needs_grad(q, k, v, g, beta, initial_state)
    captures = [(i, p) for i, ps in enumerate(state_positions or ()) for p in ps]
    if any(not 0 < p < x.lens[i] for i, p in captures) or (captures and grad):
        raise ValueError(f"state_positions must lie inside their sequences (lengths {x.lens}), without autograd")
    cap = x.v.new_empty(len(captures), hv, dk, dv, dtype=acc)
    o, final = _forward(x, lay, x.v.to(acc), gf, x.beta.to(acc), state, l2=use_qk_l2norm_in_kernel,
                        grad=grad, floor=lowest < G_FLOOR, captures=captures, c_dst=cap)
    out = o.to(x.dtype).view(x.out_shape), (final if output_final_state else None)
    return out if state_positions is None else (*out, per_sequence(cap, state_positions))
