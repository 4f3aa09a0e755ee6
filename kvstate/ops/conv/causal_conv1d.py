"""Causal depthwise conv1d over a (packed) sequence: the short conv of Mamba, GatedDeltaNet and KDA.

y_t[d] = bias[d] + sum_w weight[d, w] * x_{t - (W-1) + w}[d], then an optional silu, where inputs
before the sequence start come from its conv state. The state is transformers' cache layout:
[N, D, W] holding the last W inputs, the newest in the last column, older ones zero-padded at the
start (a state of W-1 columns is accepted too: only the last W-1 columns are ever read).

Token-first [B, T, D] is computed as W shifted multiply-adds over contiguous rows, not with
F.conv1d: the channel-first conv needs two transposes and depthwise F.conv1d is itself slow on
CPU (transformers' F.conv1d fallback measured 2-3x slower at T=2048, D=8192 even on contiguous
channel-first input; `kvstate bench ops --only causal_conv1d`); F.conv1d is the tests' reference.
The shifts run over the packed rows as if they were one sequence; then the first W-1 rows of every
sequence, the only ones that saw a neighbour's tokens, are recomputed from its own state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvstate.ops._common import check, check_cu_seqlens, num_sequences, seq_bounds

ACTIVATIONS = (None, "silu", "swish")


def check_activation(activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def causal_conv1d(x, weight, bias=None, *, activation=None, initial_state=None, output_final_state=False,
                  cu_seqlens=None):
    """x [B, T, D] (packed [1, sum(T), D] with cu_seqlens), weight [D, W], bias [D] ->
    (y [B, T, D] in x's dtype, final_state [N, D, W] in x's dtype or None). Differentiable."""
    check("x", x, 3)
    b, t, d = x.shape
    check("weight", weight, shape=(d, None))
    w_len = weight.shape[1]
    if w_len < 1:
        raise ValueError("weight must have at least one tap")
    if bias is not None:
        check("bias", bias, shape=(d,))
    check_activation(activation)
    check_cu_seqlens(cu_seqlens, b, t)
    n = num_sequences(b, cu_seqlens)
    if initial_state is not None:
        check("initial_state", initial_state, shape=(n, d, None))
        if initial_state.shape[2] not in (w_len, w_len - 1):
            raise ValueError(f"initial_state must have {w_len} or {w_len - 1} columns, got {initial_state.shape[2]}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    starts, lengths = seq_bounds(b, t, cu_seqlens)
    rows = x.to(dtype).reshape(b * t, d)  # packed rows [sum(T), D]
    taps = weight.to(dtype).t().contiguous()  # [W, D] contiguous rows: taps[W-1] multiplies the newest input
    # the full history before each sequence, token-first: [N, W, D] (oldest first)
    history = rows.new_zeros(n, w_len, d)
    if initial_state is not None:
        history[:, w_len - initial_state.shape[2]:] = initial_state.to(dtype).transpose(1, 2)

    y = torch.addcmul(bias.to(dtype), rows, taps[-1]) if bias is not None else rows * taps[-1]
    for s in range(1, min(w_len, b * t)):
        y[s:].addcmul_(rows[:-s], taps[-1 - s])  # row r += x_{r-s} * weight[:, W-1-s]
    if w_len > 1 and n:
        _fix_heads(y, rows, taps, bias, history, lengths, starts)
    if activation is not None:
        y = F.silu(y, inplace=not y.requires_grad)
    y = y.view(b, t, d).to(x.dtype)
    if not output_final_state:
        return y, None
    return y, _final_state(rows, history, lengths, starts).to(x.dtype)


def _fix_heads(y, rows, taps, bias, history, lengths, starts):
    """Recompute rows start_i + j, j < min(W-1, T_i), from sequence i's own history."""
    w_len, d = taps.shape
    n, dev = len(lengths), rows.device
    head = w_len - 1
    j = torch.arange(head, device=dev)
    first = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + j  # [N, W-1] packed rows
    real = j[None, :] < torch.tensor(lengths, dtype=torch.long, device=dev)[:, None]  # [N, W-1]
    if not bool(real.any()):
        return
    # context [N, 2(W-1), D]: the last W-1 history rows, then the sequence's first W-1 tokens
    tokens = rows.index_select(0, torch.where(real, first, 0).flatten())
    ctx = torch.cat([history[:, 1:], tokens.view(n, head, d)], dim=1)
    out = ctx[:, :head] * taps[0]
    for w in range(1, w_len):
        out = out + ctx[:, w : w + head] * taps[w]  # out[:, j] = sum_w taps[w] * ctx[:, j + w]
    if bias is not None:
        out = out + bias.to(out.dtype)
    y.index_copy_(0, first[real], out[real])


def _final_state(rows, history, lengths, starts):
    """The last W inputs of [history ; tokens] per sequence -> [N, D, W] (newest last)."""
    n, w_len, d = history.shape
    dev = rows.device
    lens = torch.tensor(lengths, dtype=torch.long, device=dev)[:, None]
    v = lens + torch.arange(w_len, device=dev)  # [N, W] position in the virtual [history (W) ; tokens]
    old = v < w_len  # still a history row (the sequence has fewer than W tokens)
    from_history = history.gather(1, torch.where(old, v, 0)[..., None].expand(n, w_len, d))
    if rows.shape[0] == 0:
        return from_history.transpose(1, 2).contiguous()
    token = torch.tensor(starts, dtype=torch.long, device=dev)[:, None] + v - w_len
    from_tokens = rows.index_select(0, torch.where(old, 0, token).flatten()).view(n, w_len, d)
    return torch.where(old[..., None], from_history, from_tokens).transpose(1, 2).contiguous()
