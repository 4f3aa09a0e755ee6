"""Reading and writing a batch's rows of a state-slot pool (recurrent or conv state)."""

from __future__ import annotations

import torch


def read_slots(pool: torch.Tensor, batch) -> torch.Tensor:
    """pool [num_slots, *shape] -> [N, *shape] for the batch's sequences, in fp32 for recurrent pools.

    A sequence with an empty cache starts from zeros whatever its slot held before.
    """
    rows = pool.index_select(0, batch.state_slots)
    fresh = batch.context_lens == 0
    if bool(fresh.any()):
        rows[fresh] = 0
    return rows


def decode_pool(pool: torch.Tensor, batch) -> dict:
    """Arguments for a recurrent op that updates the batch's rows of `pool` in place (no gather, no
    scatter, no fresh state allocation): rows of sequences with an empty cache are zeroed first."""
    fresh = batch.context_lens == 0
    if bool(fresh.any()):
        pool[batch.state_slots[fresh]] = 0
    return dict(initial_state=pool, state_indices=batch.state_slots, inplace_final_state=True)


def write_slots(pool: torch.Tensor, batch, rows: torch.Tensor) -> None:
    """rows [N, *shape] -> the batch's slots. A conv pool kept at kernel - 1 columns takes the newest ones."""
    if rows.shape[-1] != pool.shape[-1]:
        rows = rows[..., -pool.shape[-1]:]
    pool.index_copy_(0, batch.state_slots, rows.to(pool.dtype))


def short_conv(x: torch.Tensor, pool: torch.Tensor, batch, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None) -> torch.Tensor:
    """The short causal depthwise conv of a linear mixer: x [T, D] -> [T, D], carrying each sequence's
    conv window [D, W] in its state slot (one-step update for an all-decode batch, else varlen prefill)."""
    from kvstate.ops import causal_conv1d, causal_conv1d_update

    state = read_slots(pool, batch)  # [N, D, W]
    if batch.decode_only:
        y = causal_conv1d_update(x, state, weight, bias, activation=activation)  # updates `state` in place
    else:
        y, state = causal_conv1d(x[None], weight, bias, activation=activation, initial_state=state,
                                 output_final_state=True, cu_seqlens=batch.cu_seqlens)
        y = y[0]
    write_slots(pool, batch, state)
    return y
