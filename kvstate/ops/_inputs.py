"""The one input preparation of the q/k/v ops (delta rule, gated delta rule, (gated) linear
attention, SSD through it, KDA): checks, then the inputs flattened to tokens.

Every form of these ops takes `(q, k, v, [g], [beta], *, scale, initial_state, cu_seqlens, ...)`
and sees a batch the same way: q, k [tot, H, K], v [tot, HV, V], beta [tot, HV] and the log-decay
g in one of two shapes, plus the host-side sequence bounds (a [B, T] batch is B sequences of T
tokens; a packed batch is cut by `cu_seqlens`). The shape of g is what tells the ops apart:

    g_shape="head"     g [B, T, HV]      one scalar decay per value head (GDN, gated LA, SSD)
    g_shape="channel"  g [B, T, HV, K]   a decay per key channel (KDA)
    g None                               no decay (plain delta rule, linear attention)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstate.ops._common import check, check_cu_seqlens, check_qkv, compute_dtype, l2norm, seq_bounds


@dataclass
class FlatInputs:
    """Validated inputs, flattened to tokens (as given: cast to `acc` where they are used)."""

    q: torch.Tensor  # [tot, H, K]
    k: torch.Tensor  # [tot, H, K]
    v: torch.Tensor  # [tot, HV, V]
    g: torch.Tensor | None  # [tot, HV] or [tot, HV, K] (log decay <= 0), None = no decay
    beta: torch.Tensor | None  # [tot, HV]
    lens: list[int]  # tokens per sequence
    starts: list[int]  # first token of each sequence in the flat layout
    out_shape: tuple[int, ...]  # [B, T, HV, V] of the output
    scale: float
    s0: torch.Tensor | None  # initial_state as given: [N, HV, K, V] (or a pool [P, ...]), None = zeros
    dtype: torch.dtype  # q's dtype: outputs come back in it
    acc: torch.dtype  # accumulation dtype (fp32, fp64 when an input is fp64)

    @property
    def n_seq(self) -> int:
        return len(self.lens)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(H, HV, K, V)."""
        return self.q.shape[1], self.v.shape[1], self.q.shape[2], self.v.shape[2]


def prepare(q, k, v, g, beta, *, scale, initial_state, cu_seqlens, needs_beta: bool, g_shape: str = "head",
            pool: bool = False) -> FlatInputs:
    """Check the contract's shapes (ValueError naming the argument) and flatten to tokens.

    `g_shape`: "head" or "channel" (see the module docstring). `pool`: `initial_state` is a state
    pool indexed by `state_indices` (recurrent forms), so its number of rows is free; otherwise it
    has one row per sequence.
    """
    b, t, h, dk, hv, dv = check_qkv(q, k, v)
    if g is not None or g_shape == "channel":
        check("g", g, shape=(b, t, hv) if g_shape == "head" else (b, t, hv, dk))
    if needs_beta or beta is not None:
        check("beta", beta, shape=(b, t, hv))
    check_cu_seqlens(cu_seqlens, b, t)
    starts, lens = seq_bounds(b, t, cu_seqlens)
    if initial_state is not None:
        check("initial_state", initial_state, shape=(None if pool else len(lens), hv, dk, dv))
    scale = dk**-0.5 if scale is None else float(scale)
    flat = lambda x: None if x is None else x.reshape(b * t, *x.shape[2:])  # noqa: E731
    return FlatInputs(flat(q), flat(k), flat(v), flat(g), flat(beta), lens, starts, (b, t, hv, dv), scale,
                      initial_state, q.dtype, compute_dtype(q, k, v, g, beta))


def normalize_qk(q: torch.Tensor, k: torch.Tensor, acc: torch.dtype, l2: bool, inplace: bool = False,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Cast to the accumulation dtype, optionally L2-normalize (eps 1e-6, as fla/transformers) and
    scale q (folded into its norm factor).

    `inplace` scales tensors the caller owns (fresh gathers, no autograd) without a copy.
    """
    q, k = q.to(acc), k.to(acc)
    if l2 and inplace:
        qf = torch.rsqrt(torch.linalg.vector_norm(q, dim=-1, keepdim=True).square_().add_(1e-6))
        q.mul_(qf if scale is None else qf.mul_(scale))
        k.mul_(torch.rsqrt(torch.linalg.vector_norm(k, dim=-1, keepdim=True).square_().add_(1e-6)))
    elif l2:
        q = l2norm(q) if scale is None else q * (torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale)
        k = l2norm(k)
    elif scale is not None:
        q = q.mul_(scale) if inplace else q * scale
    return q, k
