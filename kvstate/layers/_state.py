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


def write_slots(pool: torch.Tensor, batch, rows: torch.Tensor) -> None:
    """rows [N, *shape] -> the batch's slots. A conv pool kept at kernel - 1 columns takes the newest ones."""
    if rows.shape[-1] != pool.shape[-1]:
        rows = rows[..., -pool.shape[-1]:]
    pool.index_copy_(0, batch.state_slots, rows.to(pool.dtype))
