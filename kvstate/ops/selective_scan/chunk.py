"""Mamba-1 selective scan, the fast prefill form (blocked scan, differentiable).

Same semantics and arguments as `naive_selective_scan` (mamba_ssm's `selective_scan_fn` names,
token-first layouts). Batches and packed varlen batches go through one path: the tokens are
viewed as packed rows and walked in cache-sized blocks over the live sequences, longest first
(kvstate/ops/_layout.py `ScanLayout`); scan_fn.py says why a sequential scan beats a matmul form
when the decay is per channel.
"""

from __future__ import annotations

from kvstate.ops import _layout
from kvstate.ops._common import seq_bounds
from kvstate.ops.selective_scan import inputs
from kvstate.ops.selective_scan.inputs import check_inputs, compute_dtype, discretize_dt, epilogue, grouped, initial
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
    starts, lens = seq_bounds(b, t, cu_seqlens)
    # a sequence that ends inside a block is padded with dt = 0, x = 0: exp(0) = 1 keeps its state
    lay = _layout.scan_layout(lens, starts, d * n, inputs.BUDGET, inputs.MAX_BLOCK, chunk_size, device=u.device)
    h0 = initial(initial_state, shape, dtype, u.device)
    y, h = selective_scan_packed(dt, x, A.to(dtype), Bm, Cm, h0, lay)
    y = epilogue(y.view(b, t, d), u, D, z, u.dtype)
    return y, (h if output_final_state else None)
