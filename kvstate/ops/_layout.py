"""The sorted, step-major layout of a packed varlen batch: how the chunked and blocked ops walk it.

A batch is flat tokens cut into sequences (B rows of T tokens, or a packed batch cut by
`cu_seqlens`; see `_common.seq_bounds`). Sequences are ordered longest first (stable), so the
sequences still running at any token offset are a *prefix* of that order (like PyTorch's
PackedSequence): a sequential scan then updates a prefix of its state rows, works on contiguous
slices whatever the mix of lengths, and never computes padding beyond a sequence's last block.

- `ChunkLayout` (delta family, gated linear attention, SSD, KDA): each sequence is cut into chunks
  of C tokens (its last chunk padded) laid out step-major: step j holds chunk j of every sequence
  that has one, as `slots` [S, C] of flat token indices.
- `ScanLayout` (Mamba-1 selective scan): blocks of l token offsets over k running sequences,
  [l, k] (time-major), with l sized so that the [l, k, D, N] work buffers stay in cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


def longest_first(sizes: torch.Tensor) -> torch.Tensor:
    """sizes [N] (tokens or chunks per sequence) -> order [N]: rank -> sequence, decreasing, stable."""
    return torch.argsort(-sizes, stable=True)


@dataclass
class ChunkLayout:
    """Step-major chunk layout of a batch of sequences (see the module docstring)."""

    chunk: int
    steps: list[tuple[int, int]]  # per step j: (first slot, number of sequences still running)
    order: torch.Tensor  # [N] rank -> sequence index (ranks sorted by decreasing chunk count)
    identity: bool  # order is 0..N-1
    tok: torch.Tensor  # [slots, C] flat token index of each (slot, position); padding -> 0
    pad_slots: set[int]  # slots whose chunk is not full (padding positions must be zeroed)
    valid: torch.Tensor  # [slots, C] bool, False at padding positions
    rank: torch.Tensor  # [N] sequence -> rank
    lens: torch.Tensor  # [N] tokens per sequence
    starts: torch.Tensor  # [N] first flat token of each sequence
    runs: dict = field(default_factory=dict)  # (s0, s1) -> first token of a contiguous run, or None

    @property
    def slots(self) -> int:
        return self.tok.shape[0]

    @cached_property
    def slot_pos_of_tok(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([tot] slot holding each token, [tot] its position inside the chunk); only `unchunk` needs it."""
        long = dict(dtype=torch.long, device=self.tok.device)
        seq_of_tok = torch.repeat_interleave(torch.arange(self.lens.numel(), **long), self.lens)  # [tot]
        p = torch.arange(seq_of_tok.numel(), **long) - self.starts[seq_of_tok]  # position inside its sequence
        if not self.steps:
            return p, p
        first = torch.tensor([f for f, _ in self.steps], **long)  # [J] first slot of each step
        return first[p // self.chunk] + self.rank[seq_of_tok], p % self.chunk

    def by_rank(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [N, ...] in sequence order -> rank order (x itself when the order is the identity)."""
        return x if self.identity else x.index_select(0, self.order)

    def by_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [N, ...] in rank order -> sequence order (the inverse of `by_rank`)."""
        return x if self.identity else torch.empty_like(x).index_copy(0, self.order, x)

    def run_start(self, s0: int, s1: int) -> int | None:
        """First token if slots s0..s1 cover one contiguous token range without padding, else None."""
        key = (s0, s1)
        if key not in self.runs:
            tok = self.tok[s0:s1].flatten()
            t0 = int(tok[0]) if tok.numel() else 0
            ok = not any(s in self.pad_slots for s in range(s0, s1)) and bool(
                (tok == torch.arange(t0, t0 + tok.numel(), device=tok.device)).all())
            self.runs[key] = t0 if ok else None
        return self.runs[key]

    def blocks(self, per_slot: int, budget: int):
        """Split the steps into blocks of about `budget` (in units of `per_slot`, e.g. bytes of
        [slots, ...] temporaries); a block holds at least one step.

        Yields (first slot, end slot, [(slot offset, active, active at the next step), ...]).
        """
        block, start = [], 0
        for j, (off, m) in enumerate(self.steps):
            m_next = self.steps[j + 1][1] if j + 1 < len(self.steps) else 0
            block.append((off, m, m_next))
            if (off + m - start) * per_slot >= budget:
                yield start, off + m, block
                block, start = [], off + m
        if block:
            yield start, block[-1][0] + block[-1][1], block


def chunk_layout(lens: list[int], starts: list[int], chunk: int, device: torch.device) -> ChunkLayout:
    """Sequences of `lens` tokens starting at flat rows `starts` -> their step-major chunk layout."""
    long = dict(dtype=torch.long, device=device)
    lens_t, starts_t = torch.tensor(lens, **long), torch.tensor(starts, **long)
    n_chunks = (lens_t + chunk - 1) // chunk  # [N]
    order = longest_first(n_chunks)  # rank -> sequence
    rank = torch.empty_like(order).index_copy_(0, order, torch.arange(len(lens), **long))
    n_steps = int(n_chunks.max()) if len(lens) else 0
    active = (n_chunks[order][None, :] > torch.arange(n_steps, **long)[:, None]).sum(1)  # [J] running per step
    first = torch.cumsum(active, 0) - active  # [J] first slot of each step
    steps = list(zip(first.tolist(), active.tolist()))
    step_of_slot = torch.repeat_interleave(torch.arange(n_steps, **long), active)  # [S]
    seq = order[torch.arange(step_of_slot.numel(), **long) - first[step_of_slot]]  # [S] sequence of each slot
    pos = step_of_slot[:, None] * chunk + torch.arange(chunk, **long)  # [S, C] position inside its sequence
    valid = pos < lens_t[seq][:, None]
    tok = torch.where(valid, starts_t[seq][:, None] + pos, 0)
    pad_slots = set(torch.nonzero(~valid.all(1)).flatten().tolist())
    identity = bool((order == torch.arange(len(lens), **long)).all())
    return ChunkLayout(chunk, steps, order, identity, tok, pad_slots, valid, rank, lens_t, starts_t)


def gather(x: torch.Tensor, lay: ChunkLayout, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
    """Tokens [tot, H, *D] -> chunks [s1 - s0, H, C, *D] of slots s0..s1, padding zeroed."""
    n, c = s1 - s0, lay.chunk
    t0 = lay.run_start(s0, s1)
    xs = x[t0:t0 + n * c] if t0 is not None else x.index_select(0, lay.tok[s0:s1].flatten())
    # always a fresh tensor (callers may scale it in place), even when the transpose is a no-op
    out = xs.view(n, c, *x.shape[1:]).transpose(1, 2).to(dtype, copy=True, memory_format=torch.contiguous_format)
    if any(s in lay.pad_slots for s in range(s0, s1)):
        mask = lay.valid[s0:s1][:, None, :]
        out = out * mask.reshape(*mask.shape, *([1] * (out.dim() - 3))).to(dtype)
    return out


def scatter_(out: torch.Tensor, y: torch.Tensor, lay: ChunkLayout, s0: int) -> None:
    """Write chunks y [n, HV, C, V] of slots s0.. into the token output out [tot, HV, V] (in place)."""
    n, c = y.shape[0], lay.chunk
    t0 = lay.run_start(s0, s0 + n)
    yt = y.transpose(1, 2)  # [n, C, HV, V]
    if t0 is not None:
        out[t0:t0 + n * c].view(n, c, *out.shape[1:]).copy_(yt)
    else:
        valid = lay.valid[s0:s0 + n]
        out[lay.tok[s0:s0 + n][valid]] = yt[valid].to(out.dtype)


def unchunk(y: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """Chunks y [slots, HV, C, V] -> tokens [tot, HV, V] (differentiable)."""
    slot, pos = lay.slot_pos_of_tok
    heads = torch.arange(y.shape[1], device=y.device)
    return y[slot[:, None], heads[None, :], pos[:, None]]


@dataclass
class ScanBlock:
    """Token offsets start .. start+length-1 of the sorted sequences first .. first+seqs-1."""

    start: int  # token offset c0 inside every sequence
    length: int  # l
    first: int  # the first sorted sequence of the block
    seqs: int  # k: sorted sequences first .. first + k - 1, all running at offset c0
    index: torch.Tensor  # [l, k] flat row of (offset c0 + j, sorted sequence i); clamped if padding
    valid: torch.Tensor | None  # [l, k] bool, None when every entry is a real token
    rows: torch.Tensor  # [n_valid] the flat rows of the real tokens, in [l, k] order


@dataclass
class ScanLayout:
    order: torch.Tensor  # [N_seq] rank -> sequence (longest first)
    blocks: list[ScanBlock]


def scan_layout(lens: list[int], starts: list[int], width: int, budget: int, max_block: int,
                block: int | None = None, device=None) -> ScanLayout:
    """Blocks for sequences of `lens` tokens starting at flat rows `starts`.

    `width` = elements per token state (D * N); a block's [l, k, width] buffer holds about `budget`
    elements and l <= max_block; `block` forces l (tests use it). A sequence that ends inside a
    block is padded there (the scan makes padding leave the state unchanged).
    """
    order = longest_first(torch.tensor(lens, dtype=torch.long))
    lens_s = torch.tensor(lens, dtype=torch.long)[order]  # [N] in rank order
    firsts = torch.tensor(starts, dtype=torch.long)[order] if lens else lens_s
    blocks: list[ScanBlock] = []
    longest = int(lens_s[0]) if lens else 0
    c0 = 0
    while c0 < longest:
        live = int((lens_s > c0).sum())  # a prefix of the ranks
        group = max(1, min(live, budget // width))  # sequences per block
        l = min(block or max(1, min(max_block, budget // (group * width))), longest - c0)  # noqa: E741
        offsets = c0 + torch.arange(l, dtype=torch.long)[:, None]  # [l, 1]
        for s0 in range(0, live, group):
            k = min(group, live - s0)
            valid = offsets < lens_s[None, s0:s0 + k]  # [l, k]
            index = firsts[None, s0:s0 + k] + offsets
            if bool(valid.all()):
                blocks.append(ScanBlock(c0, l, s0, k, index.to(device), None, index.flatten().to(device)))
            else:
                index = torch.where(valid, index, firsts[None, s0:s0 + k])
                blocks.append(ScanBlock(c0, l, s0, k, index.to(device), valid.to(device), index[valid].to(device)))
        c0 += l
    return ScanLayout(order.to(device), blocks)


def scan_gather(x: torch.Tensor, blk: ScanBlock) -> torch.Tensor:
    """Flat rows [sum(T), *rest] -> [l, k, *rest]; padding entries are zero."""
    out = x.index_select(0, blk.index.flatten()).view(blk.length, blk.seqs, *x.shape[1:])
    if blk.valid is not None:
        out.masked_fill_(~blk.valid.view(blk.length, blk.seqs, *([1] * (x.dim() - 1))), 0)
    return out


def scan_scatter(dst: torch.Tensor, src: torch.Tensor, blk: ScanBlock) -> None:
    """dst [sum(T), *rest] <- the real tokens of src [l, k, *rest] (each row is written once)."""
    if blk.valid is None:
        dst.index_copy_(0, blk.rows, src.reshape(-1, *dst.shape[1:]))
    else:
        dst.index_copy_(0, blk.rows, src[blk.valid])
