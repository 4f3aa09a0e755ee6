"""Mamba-1 selective scan, the fast prefill form (blocked scan, differentiable).

Same semantics and arguments as `naive_selective_scan` (mamba_ssm's `selective_scan_fn` names,
token-first layouts). Batches and packed varlen batches go through one path: the tokens are
viewed as packed rows and walked in cache-sized blocks over the live sequences (see plan.py and
scan_fn.py for why a sequential scan beats a matmul form when the decay is per channel).
"""

from __future__ import annotations

from kvstate.ops.selective_scan.inputs import (
    check_inputs, compute_dtype, discretize_dt, epilogue, grouped, initial,
)
from kvstate.ops.selective_scan.plan import make_plan
from kvstate.ops.selective_scan.scan_fn import selective_scan_packed


def chunk_selective_scan(u, delta, A, B, C, *, D=None, z=None, delta_bias=None, delta_softplus=False,
                         initial_state=None, output_final_state=False, cu_seqlens=None, chunk_size=None):
    """Returns (y [B, T, D] in u's dtype, final_state [N_seq, D, N] fp32 or None).

    u, delta, z [B, T, D]; A [D, N] (<= 0); B, C [B, T, N] or [B, T, G, N]; D, delta_bias [D];
    initial_state [N_seq, D, N]; cu_seqlens [N_seq + 1] for a packed [1, sum(T), ...] batch.
    `chunk_size` forces the block length (default: sized to keep the work buffers in cache).
    """
    shape = check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state, cu_seqlens)
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    dtype = compute_dtype(u, delta, A, B, C)
    b, t, d, n, g = shape.batch, shape.seqlen, shape.dim, shape.state, shape.groups
    dt = discretize_dt(delta, delta_bias, delta_softplus, dtype).reshape(b * t, d)  # packed rows
    x = dt * u.to(dtype).reshape(b * t, d)
    Bm = grouped(B).to(dtype).reshape(b * t, g, n)
    Cm = grouped(C).to(dtype).reshape(b * t, g, n)
    if cu_seqlens is None:
        lengths, starts = [t] * b, [i * t for i in range(b)]
    else:
        bounds = cu_seqlens.tolist()
        lengths, starts = [e - s for s, e in zip(bounds[:-1], bounds[1:])], bounds[:-1]
    plan = make_plan(lengths, starts, d * n, chunk_size, device=u.device)
    h0 = initial(initial_state, shape, dtype, u.device)
    y, h = selective_scan_packed(dt, x, A.to(dtype), Bm, Cm, h0, plan)
    y = epilogue(y.view(b, t, d), u, D, z, u.dtype)
    return y, (h if output_final_state else None)
