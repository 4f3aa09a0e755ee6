"""The step-major chunk layout of a batch of sequences, for the chunk form.

A batch is flat tokens cut into sequences (B rows of T tokens, or a packed batch cut by
cu_seqlens). Each sequence is cut into chunks of C tokens (its last chunk padded), and chunks
are laid out step-major: step j holds chunk j of every sequence that has one, sequences sorted
by decreasing chunk count, so the sequences still running at step j are always a prefix of that
order (like PyTorch's PackedSequence). The scan over chunks then updates a prefix of the state
rows and never computes padding chunks; sequences of very different lengths cost their own
length, not the longest one's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkLayout:
    order: torch.Tensor  # [N]: sequences by decreasing chunk count (stable); row r of the scan is order[r]
    active: list[int]  # per step: how many sequences (a prefix of `order`) have a chunk there
    offsets: list[int]  # per step: first chunk of the step; offsets[-1] = number of chunks
    tokens: torch.Tensor  # [chunks, C]: flat token index of each position (0 for padding)
    valid: torch.Tensor  # [chunks, C] bool: a real token, not padding

    @property
    def steps(self) -> int:
        return len(self.active)


def chunk_layout(lens: torch.Tensor, c: int, device: torch.device | None = None) -> ChunkLayout:
    """lens [N] (int64 on the CPU, tokens per sequence, laid out back to back) -> the step-major
    layout; its index tensors go to `device`."""
    starts = torch.cumsum(lens, 0) - lens
    counts = (lens + c - 1) // c
    order = torch.sort(counts, descending=True, stable=True).indices
    steps = int(counts.max()) if counts.numel() else 0
    has = counts[order].unsqueeze(0) > torch.arange(steps).unsqueeze(1)  # [steps, N]
    step, rank = has.nonzero(as_tuple=True)  # row-major: step by step, ranks in order
    seq = order[rank]
    pos = step.unsqueeze(1) * c + torch.arange(c)  # [chunks, C]: position inside the sequence
    valid = pos < lens[seq].unsqueeze(1)
    tokens = torch.where(valid, starts[seq].unsqueeze(1) + pos, 0)
    active = has.sum(1)
    offsets = [0] + torch.cumsum(active, 0).tolist()
    return ChunkLayout(order=order.to(device), active=active.tolist(), offsets=offsets, tokens=tokens.to(device),
                       valid=valid.to(device))
