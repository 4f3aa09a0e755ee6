"""The core of the fast selective scan: a blocked sequential scan with its own backward.

With a per-channel decay exp(dt_t[d] * A[d, n]) the state after every token is a distinct [D, N]
matrix, so any "parallel" form (masked [L, L] weights per (d, n), log-space prefix scans) costs
L/2 times more exp() calls or more passes over memory than the plain recurrence, and exp() of
T * D * N numbers is already most of the time. So we scan token by token, but with one in-place
op per token (s_t += s_{t-1} * a_t) over cache-sized [l, k, D, N] buffers whose inputs
(a = exp(dt A), s = x B) and outputs (y = s . C) are computed for the whole block at once.

The backward recomputes each block from the state saved at its start (O(T/l) saved states, not
O(T)) and runs the reverse recurrence g_t = C_t gy_t + a_{t+1} g_{t+1} the same way.
Only exp(dt * A) with dt >= 0, A <= 0 is ever taken: no exp of a positive number.
"""

from __future__ import annotations

import torch

from kvstate.ops._layout import ScanLayout, scan_gather, scan_scatter


def _block_states(dt_c, x_c, A, B_c, h_start, a_buf, s_buf):
    """dt_c, x_c [l, k, D]; B_c [l, k, G, N]; h_start [k, D, N] -> (a, s) views [l, k, D, N].

    a_t = exp(dt_t A) and s_t = a_t * s_{t-1} + x_t B_t, the state after token t.
    """
    l, k, d = dt_c.shape
    g, n = B_c.shape[2], B_c.shape[3]
    a = a_buf[: l * k * d * n].view(l, k, g, d // g, n)
    torch.mul(dt_c.view(l, k, g, d // g, 1), A.view(g, d // g, n), out=a)
    a.exp_()
    s = s_buf[: l * k * d * n].view(l, k, g, d // g, n)
    torch.mul(x_c.view(l, k, g, d // g, 1), B_c.view(l, k, g, 1, n), out=s)
    a, s = a.view(l, k, d, n), s.view(l, k, d, n)
    s[0].addcmul_(h_start, a[0])
    for t in range(1, l):
        s[t].addcmul_(s[t - 1], a[t])
    return a, s


def _contract_n(s, v):
    """sum_n s[l, k, D, N] * v[l, k, G, N] over n for grouped channels -> [l, k, D]."""
    l, k, d, n = s.shape
    g = v.shape[2]
    return torch.linalg.vecdot(s.view(l, k, g, d // g, n), v.view(l, k, g, 1, n)).view(l, k, d)


def _contract_d(s, w, groups):
    """sum over the channels of a group of s[l, k, D, N] * w[l, k, D] -> [l, k, G, N]."""
    l, k, d, n = s.shape
    m = l * k * groups
    return torch.bmm(w.reshape(m, 1, d // groups), s.view(m, d // groups, n)).view(l, k, groups, n)


class SelectiveScanFn(torch.autograd.Function):
    """(dt, x [sum(T), D], A [D, N], B, C [sum(T), G, N], h0 [N_seq, D, N]) -> (y [sum(T), D], h_T).

    y_t = h_t . C_t without the D skip or the z gate (autograd handles those around it).
    """

    @staticmethod
    def forward(ctx, dt, x, A, Bm, Cm, h0, lay: ScanLayout, keep: bool):
        dim, n = A.shape
        y = dt.new_empty(dt.shape)
        h = h0.index_select(0, lay.order)  # [N_seq, D, N] in sorted order
        size = max((b.length * b.seqs for b in lay.blocks), default=0) * dim * n
        a_buf, s_buf = dt.new_empty(size), dt.new_empty(size)
        starts = []
        for blk in lay.blocks:
            seqs = slice(blk.first, blk.first + blk.seqs)
            if keep:  # the state at each block start, for the backward's recomputation
                starts.append(h[seqs].clone())
            dt_c, x_c = scan_gather(dt, blk), scan_gather(x, blk)
            a, s = _block_states(dt_c, x_c, A, scan_gather(Bm, blk), h[seqs], a_buf, s_buf)
            h[seqs] = s[-1]
            scan_scatter(y, _contract_n(s, scan_gather(Cm, blk)), blk)
        h_final = torch.empty_like(h).index_copy_(0, lay.order, h)
        ctx.save_for_backward(dt, x, A, Bm, Cm)
        ctx.lay, ctx.starts = lay, starts
        return y, h_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy, gh_final):
        dt, x, A, Bm, Cm = ctx.saved_tensors
        lay: ScanLayout = ctx.lay
        dim, n = A.shape
        groups = Bm.shape[1]
        g_dt, g_x = torch.zeros_like(dt), torch.zeros_like(x)
        g_B, g_C = torch.zeros_like(Bm), torch.zeros_like(Cm)
        g_A = torch.zeros_like(A)
        carry = gh_final.index_select(0, lay.order)  # dL/dh at the end of what is done so far
        size = max((b.length * b.seqs for b in lay.blocks), default=0) * dim * n
        a_buf, s_buf, g_buf = dt.new_empty(size), dt.new_empty(size), dt.new_empty(size)
        for blk, h_start in zip(reversed(lay.blocks), reversed(ctx.starts)):
            l, k, seqs = blk.length, blk.seqs, slice(blk.first, blk.first + blk.seqs)
            dt_c, x_c, B_c, C_c = scan_gather(dt, blk), scan_gather(x, blk), scan_gather(Bm, blk), scan_gather(Cm, blk)
            gy_c = scan_gather(gy, blk)  # [l, k, D], zero on padding
            a, s = _block_states(dt_c, x_c, A, B_c, h_start, a_buf, s_buf)
            # g_t = dL/dh_t = C_t gy_t + a_{t+1} g_{t+1}   [l, k, D, N]
            g = g_buf[: l * k * dim * n].view(l, k, groups, dim // groups, n)
            torch.mul(gy_c.view(l, k, groups, dim // groups, 1), C_c.view(l, k, groups, 1, n), out=g)
            g = g.view(l, k, dim, n)
            g[-1].add_(carry[seqs])
            for t in range(l - 2, -1, -1):
                g[t].addcmul_(g[t + 1], a[t + 1])
            scan_scatter(g_C, _contract_d(s, gy_c, groups), blk)
            scan_scatter(g_B, _contract_d(g, x_c, groups), blk)
            scan_scatter(g_x, _contract_n(g, B_c), blk)
            q = a.mul_(g)  # a_t g_t = dL/dh_{t-1} through the decay
            carry[seqs] = q[0]
            q[1:].mul_(s[:-1])  # q_t = a_t g_t h_{t-1} = dL/d(dt_t A)
            q[0].mul_(h_start)
            scan_scatter(g_dt, torch.linalg.vecdot(q, A), blk)
            q.mul_(dt_c[..., None])
            g_A += q.sum(dim=(0, 1))
        g_h0 = torch.empty_like(carry).index_copy_(0, lay.order, carry)
        return g_dt, g_x, g_A, g_B, g_C, g_h0, None, None


def selective_scan_packed(dt, x, A, Bm, Cm, h0, lay: ScanLayout):
    """Autograd-aware entry: see SelectiveScanFn."""
    keep = torch.is_grad_enabled() and any(t.requires_grad for t in (dt, x, A, Bm, Cm, h0))
    return SelectiveScanFn.apply(dt, x, A, Bm, Cm, h0, lay, keep)

