"""Per-chunk decay factors and intra-chunk score matrices of KDA, as matmuls that cannot overflow.

Inside a chunk we need, for j <= i,

    a(x_i, k_j) = sum_k x_i[k] k_j[k] exp(G_i[k] - G_j[k])          (x = q, and x = k)

with G the cumulative log-decay (per channel, non-increasing). Factoring it as
(x exp(G)) @ (k exp(-G))^T is one matmul but exp(-G) overflows as soon as the decay inside the
chunk passes ~88 nats (g = -1e4 does it in one token). transformers avoids the overflow by
broadcasting a [C, C, K] tensor, which is exact but slow.

Here the chunk is cut into sub-chunks of 16 rows. Row block r takes as reference point R_r the
cumulative decay just before it, so exp(G_i - R_r) <= 1 for its rows and exp(R_r - G_j) <= 1 for
every earlier column: all off-diagonal blocks are exact matmuls. The diagonal block shares the
same matmul, where the column factors exp(R_r - G_j) are >= 1; they stay finite and exact while
the decay across the block is at most SAFE_EXPONENT nats. Channels past that in a block (fast-
forgetting channels; every channel when g = -1e4) leave the matmul and are summed exactly, pair
by pair, for that block only.
fla's KDA kernels use the same idea (sub-chunks with a reference point, the diagonal blocks apart).

Every exponent is a sum of g's over the segment it spans (in-block prefix and suffix sums, sums of
whole blocks), never a difference G_i - G_j of chunk prefix sums: after a steep drop (G ~ -1e4)
such a difference loses ~1e-3 nats to cancellation in fp32, a 0.1% error in its exp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUB_CHUNK = 16
# Largest exponent allowed in a factorized diagonal block: exp(50) * |q| |k| stays far from fp32
# overflow and exp(-50) far from denormals, so every product term keeps full relative precision.
SAFE_EXPONENT = 50.0
_FIX_BATCH = 512  # (block, channel) pairs summed exactly per step: temporaries of ~0.5 MiB stay in L2


@dataclass
class Decay:
    """Decay factors of B chunks cut into n blocks of `sub` tokens (all exponents <= 0)."""

    local: torch.Tensor  # [B, n, sub, K]: sum of g from the block start to token i (inclusive)
    e_local: torch.Tensor  # exp(local)
    e_tail: torch.Tensor  # [B, n, sub, K]: exp(sum of g after token j to the block end)
    total: torch.Tensor  # [B, n, K]: sum of g over each block
    e_before: torch.Tensor  # [B, n, 1, K]: exp(sum of g over the blocks before block r)
    e_after: torch.Tensor  # [B, n, 1, K]: exp(sum of g over the blocks after block r)

    def whole(self) -> torch.Tensor:
        """exp(G_C): decay across the chunk. [B, K]"""
        return self.e_before[:, -1, 0] * self.total[:, -1].exp()


def _ones(sub: int, like: torch.Tensor, diagonal: int, upper: bool) -> torch.Tensor:
    ones = torch.ones(sub, sub, dtype=like.dtype, device=like.device)
    return ones.triu(diagonal) if upper else ones.tril(diagonal)


def _exclusive(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Exclusive cumsum over dim -2 of a few rows (block totals), as a matmul with 0/1 entries."""
    n = x.shape[-2]
    return torch.matmul(_ones(n, x, 1 if reverse else -1, upper=reverse), x)


def _scan(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Inclusive cumsum over dim 2 of [B, n, sub, K] (reverse: exclusive, from the end), by
    sub - 1 adds: sums of same-sign terms, accurate; faster than cumsum along a middle dim."""
    sub = x.shape[2]
    if reverse:
        parts = [torch.zeros_like(x[:, :, -1])]
        for t in range(sub - 1, 0, -1):
            parts.append(parts[-1] + x[:, :, t])
        return torch.stack(parts[::-1], dim=2)
    parts = [x[:, :, 0]]
    for t in range(1, sub):
        parts.append(parts[-1] + x[:, :, t])
    return torch.stack(parts, dim=2)


def decay_factors(g: torch.Tensor, sub: int = SUB_CHUNK) -> Decay:
    """g [B, C, K] per-token log-decay (<= 0) -> the factors above, blocks [B, n, sub, K]."""
    gb = g.unflatten(1, (g.shape[1] // sub, sub))
    local, tail = _scan(gb, reverse=False), _scan(gb, reverse=True)
    total = local[:, :, -1]
    return Decay(local=local, e_local=local.exp(), e_tail=tail.exp(), total=total,
                 e_before=_exclusive(total, reverse=False).exp().unsqueeze(-2),
                 e_after=_exclusive(total, reverse=True).exp().unsqueeze(-2))


def _exact_channels(qb: torch.Tensor, kb: torch.Tensor, gb: torch.Tensor, unsafe: torch.Tensor):
    """The diagonal-block terms of the channels whose decay across a block passes SAFE_EXPONENT.

    qb, kb, gb [B, n, sub, K]; unsafe [B, n, K] -> two [B, n, sub, sub]: for j <= i, the sum over
    the unsafe channels of q_i k_j exp(sum of g over (j, i]), and the same with k_i for q_i
    (entries j > i hold garbage, masked by the caller). The exponent is a segment sum (a matmul
    with a 0/1 selector), never a difference G_i - G_j; only the (block, channel) pairs that need
    it are computed.
    """
    b, n, sub, dk = qb.shape
    t = torch.arange(sub, device=qb.device)
    i, j = t.repeat_interleave(sub), t.repeat(sub)  # all pairs (i, j), row-major
    sel = ((t > j[:, None]) & (t <= i[:, None])).to(qb.dtype)  # [sub * sub, sub]: tokens in (j, i]
    flat = unsafe.reshape(-1)  # [B * n * K]: (block, channel) pairs, block-major
    blk = flat.nonzero().squeeze(1) // dk  # [m]: the block of each unsafe pair
    # channel-major rows [m, sub]: one (block, channel) per row, its tokens contiguous
    qp, kp, gp = (x.transpose(-1, -2).reshape(-1, sub)[flat] for x in (qb, kb, gb))
    out_q, out_k = (qb.new_zeros(b * n, sub, sub) for _ in range(2))
    for s in range(0, blk.numel(), _FIX_BATCH):
        ps = slice(s, s + _FIX_BATCH)
        decay = torch.matmul(gp[ps], sel.t()).exp_().view(-1, sub, sub)  # [m, i, j]: 1 where j >= i
        kj = decay * kp[ps, None, :]  # k_j exp(sum of g over (j, i])
        out_q = out_q.index_add(0, blk[ps], kj * qp[ps, :, None])
        out_k = out_k.index_add(0, blk[ps], kj * kp[ps, :, None])
    return out_q.view(b, n, sub, sub), out_k.view(b, n, sub, sub)


@dataclass
class Scores:
    """Intra-chunk scores and the factored inputs the chunk form reuses ([B, n, sub, K])."""

    d: Decay
    q_loc: torch.Tensor  # q exp(local)
    k_loc: torch.Tensor  # k exp(local)
    k_tail: torch.Tensor  # k e_tail
    P: torch.Tensor  # [B, C, C]: a(q_i, k_j) for j <= i, zero elsewhere
    A: torch.Tensor  # [B, C, C]: a(k_i, k_j) for j < i, zero elsewhere


def intra_scores(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, sub: int = SUB_CHUNK) -> Scores:
    """q, k, g [B, C, K] (g the per-token log-decay, <= 0) -> Scores."""
    b, c, dk = q.shape
    n = c // sub
    d = decay_factors(g, sub)
    qb, kb = q.unflatten(1, (n, sub)), k.unflatten(1, (n, sub))
    q_loc, k_loc, k_tail = qb * d.e_local, kb * d.e_local, kb * d.e_tail
    # diagonal blocks: column factors exp(-local) >= 1, finite (the clamp) for the channels whose
    # decay across the block is at most SAFE_EXPONENT; the other channels are summed exactly
    k_diag = kb / d.e_local.clamp(min=math.exp(-SAFE_EXPONENT))
    unsafe = -d.total > SAFE_EXPONENT  # [B, n, K]
    fixed = None
    if bool(unsafe.any()):
        k_diag = k_diag * (~unsafe).unsqueeze(-2)
        fixed = _exact_channels(qb, kb, g.unflatten(1, (n, sub)), unsafe)
    lower = _ones(sub, q, 0, upper=False)
    P, A = q.new_zeros(b, c, c), q.new_zeros(b, c, c)
    for r in range(n):
        rows = slice(r * sub, (r + 1) * sub)
        if r:  # columns of the earlier blocks s: their tail times the blocks s+1 .. r-1 in between
            between = _exclusive(d.total[:, :r], reverse=True).exp().unsqueeze(-2)  # [B, r, 1, K]
            cols = (k_tail[:, :r] * between).flatten(1, 2).transpose(1, 2)  # [B, K, r sub]
            P[:, rows, : r * sub] = torch.bmm(q_loc[:, r], cols)
            A[:, rows, : r * sub] = torch.bmm(k_loc[:, r], cols)
        diag = k_diag[:, r].transpose(1, 2)  # [B, K, sub]
        dq, dk_ = torch.bmm(q_loc[:, r], diag), torch.bmm(k_loc[:, r], diag)  # [B, sub, sub]
        if fixed is not None:
            dq, dk_ = dq + fixed[0][:, r], dk_ + fixed[1][:, r]
        P[:, rows, rows] = dq * lower
        A[:, rows, rows] = dk_ * lower.tril(-1)
    return Scores(d=d, q_loc=q_loc, k_loc=k_loc, k_tail=k_tail, P=P, A=A)
