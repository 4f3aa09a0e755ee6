"""SSD argument handling shared by its three forms: checks (mamba_ssm's names) and the dt transform.

x [B, T, H, P], dt [B, T, H], A [H] (negative), B and C [B, T, G, N] (head h reads group
h // (H / G)), D [H] or [H, P], z [B, T, H, P], dt_bias [H]. As in transformers' Mamba2 torch path
(`mamba2_chunk_scan`): dt <- dt + dt_bias, then softplus when dt_softplus, then clamped to dt_limit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvstate.ops._common import check, compute_dtype


def check_ssd(x, dt, A, B, C, D, z, dt_bias) -> None:
    check("x", x, 4)
    b, t, h, p = x.shape
    check("dt", dt, shape=(b, t, h))
    check("A", A, shape=(h,))
    check("B", B, 4)
    if B.shape[:2] != (b, t):
        raise ValueError(f"B must have shape [{b}, {t}, G, N] like x, got {tuple(B.shape)}")
    if h % B.shape[2]:
        raise ValueError(f"B's groups ({B.shape[2]}) must divide x's heads ({h})")
    check("C", C, shape=tuple(B.shape))
    if D is not None and tuple(D.shape) not in ((h,), (h, p)):
        raise ValueError(f"D must have shape [{h}] or [{h}, {p}], got {tuple(D.shape)}")
    if D is not None:
        check("D", D)
    if z is not None:
        check("z", z, shape=(b, t, h, p))
    if dt_bias is not None:
        check("dt_bias", dt_bias, shape=(h,))


def discretize(x, dt, A, dt_bias, dt_softplus: bool, dt_limit) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dt [B, T, H], log decay dt * A [B, T, H]) in the accumulation dtype."""
    acc = compute_dtype(x)
    dt = dt.to(acc)
    if dt_bias is not None:
        dt = dt + dt_bias.to(acc)
    if dt_softplus:
        dt = F.softplus(dt)
    lo, hi = dt_limit
    dt = dt.clamp(min=lo, max=None if math.isinf(hi) else hi)
    return dt, dt * A.to(acc)


def finish(y: torch.Tensor, x: torch.Tensor, D, z) -> torch.Tensor:
    """y + D x, then gated by silu(z) when given (mamba_ssm's order); cast to x's dtype."""
    xf = x.to(y.dtype)
    if D is not None:
        d = D.to(y.dtype)
        y = y + xf * (d[:, None] if d.dim() == 1 else d)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(x.dtype)
