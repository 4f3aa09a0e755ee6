"""Argument checks, the shared prologue/epilogue and the cache budget of the Mamba-1 selective scan forms.

Layouts (token-first, kvstate's convention; mamba_ssm's `selective_scan_fn` is channel-first):
u, delta, z [B, T, D]; A [D, N]; B, C [B, T, N] or grouped [B, T, G, N] (channel d reads group
d // (D / G)); D, delta_bias [D]; state [N_seq, D, N] in fp32 (fp64 when the inputs are fp64).
Packed varlen batches are [1, sum(T), ...] with `cu_seqlens` [N_seq + 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstate.ops._common import check, check_cu_seqlens, compute_dtype, num_sequences

__all__ = ["BUDGET", "MAX_BLOCK", "ScanShape", "check_inputs", "compute_dtype", "discretize_dt", "epilogue",
           "grouped", "initial"]

BUDGET = 1 << 20  # elements per [l, k, D, N] work buffer (4 MiB in fp32); tuned by `kvstate bench ops`
MAX_BLOCK = 64  # tokens per block of the fast scan


@dataclass(frozen=True)
class ScanShape:
    batch: int
    seqlen: int  # T (the packed length sum(T) for varlen)
    dim: int  # D, the channels
    state: int  # N, the state size per channel
    groups: int  # G, the B/C groups over the channels
    num_seqs: int  # N_seq, the number of sequences (states)


def check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens) -> ScanShape:
    """Validate every argument (ValueError naming it) and return the problem's sizes."""
    check("u", u, 3)
    batch, seqlen, dim = u.shape
    check("delta", delta, shape=(batch, seqlen, dim))
    check("A", A, shape=(dim, None))
    n = A.shape[1]
    check("B", B)
    if B.dim() == 3:
        check("B", B, shape=(batch, seqlen, n))
        groups = 1
    else:
        check("B", B, shape=(batch, seqlen, None, n))
        groups = B.shape[2]
        if groups == 0 or dim % groups:
            raise ValueError(f"B: {groups} groups must divide the {dim} channels")
    check("C", C, shape=tuple(B.shape))
    if D is not None:
        check("D", D, shape=(dim,))
    if z is not None:
        check("z", z, shape=(batch, seqlen, dim))
    if delta_bias is not None:
        check("delta_bias", delta_bias, shape=(dim,))
    check_cu_seqlens(cu_seqlens, batch, seqlen)
    num_seqs = num_sequences(batch, cu_seqlens)
    if initial_state is not None:
        check("initial_state", initial_state, shape=(num_seqs, dim, n))
    return ScanShape(batch, seqlen, dim, n, groups, num_seqs)


def discretize_dt(delta, delta_bias, delta_softplus: bool, dtype: torch.dtype) -> torch.Tensor:
    """dt = softplus(delta + delta_bias) (or without softplus), in the compute dtype."""
    dt = delta.to(dtype)
    if delta_bias is not None:
        dt = dt + delta_bias.to(dtype)
    return F.softplus(dt) if delta_softplus else dt


def grouped(x: torch.Tensor) -> torch.Tensor:
    """B or C as [B, T, G, N] (a view; G = 1 for the plain [B, T, N] layout)."""
    return x.unsqueeze(2) if x.dim() == 3 else x


def initial(initial_state, shape: ScanShape, dtype: torch.dtype, device) -> torch.Tensor:
    """The starting state [N_seq, D, N] in the compute dtype (zeros when none is given)."""
    if initial_state is None:
        return torch.zeros(shape.num_seqs, shape.dim, shape.state, dtype=dtype, device=device)
    return initial_state.to(dtype)


def epilogue(y: torch.Tensor, u, D, z, out_dtype: torch.dtype) -> torch.Tensor:
    """y + D * u, gated by silu(z) when z is given, cast back to the input dtype."""
    if D is not None:
        y = y + u.to(y.dtype) * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y.to(out_dtype)
