"""How the fast selective scan walks a (packed) batch: blocks of tokens over the live sequences.

Sequences are sorted longest first, so the sequences still running at token offset c0 are a prefix
of that order: a block covers offsets c0 .. c0+l-1 of k of those sorted sequences (all of them
unless there are so many that one token of each overflows the budget), read from the packed
[sum(T), ...] rows by index. A sequence that ends inside a block is padded with dt = 0 and
x = 0, which leaves its state exactly unchanged (exp(0) = 1), so every state is final at the end.
The block length l bounds the [l, k, D, N] work buffers to about BUDGET elements (cache-sized).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BUDGET = 1 << 20  # elements per [l, k, D, N] buffer (4 MiB in fp32); tuned by `kvstate bench ops`
MAX_BLOCK = 64


@dataclass
class Block:
    start: int  # token offset c0 inside every sequence
    length: int  # l
    first: int  # the first sorted sequence of the block
    seqs: int  # k: sorted sequences first .. first + k - 1, all live at offset c0
    index: torch.Tensor  # [l, k] packed row of (offset c0 + j, sorted sequence i); clamped if padding
    valid: torch.Tensor | None  # [l, k] bool, None when every entry is a real token
    rows: torch.Tensor  # [n_valid] the packed rows of the real tokens, in [l, k] order


@dataclass
class Plan:
    order: torch.Tensor  # [N_seq] sorted position -> sequence id (longest first)
    blocks: list[Block]


def make_plan(lengths: list[int], starts: list[int], width: int, block: int | None = None,
              device=None) -> Plan:
    """Blocks for sequences of `lengths` starting at packed rows `starts`.

    `width` = D * N elements per token state; `block` forces the block length (tests use it).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    lens = torch.tensor([lengths[i] for i in order], dtype=torch.long)
    firsts = torch.tensor([starts[i] for i in order], dtype=torch.long)
    blocks: list[Block] = []
    longest = int(lens[0]) if len(order) else 0
    c0 = 0
    while c0 < longest:
        live = int((lens > c0).sum())
        group = max(1, min(live, BUDGET // width))  # sequences per block
        l = block or max(1, min(MAX_BLOCK, BUDGET // (group * width)))
        l = min(l, longest - c0)
        offsets = c0 + torch.arange(l, dtype=torch.long)[:, None]  # [l, 1]
        for s0 in range(0, live, group):
            k = min(group, live - s0)
            valid = offsets < lens[None, s0 : s0 + k]  # [l, k]
            index = firsts[None, s0 : s0 + k] + offsets
            if bool(valid.all()):
                blocks.append(Block(c0, l, s0, k, index.to(device), None, index.flatten().to(device)))
            else:
                index = torch.where(valid, index, firsts[None, s0 : s0 + k])
                blocks.append(Block(c0, l, s0, k, index.to(device), valid.to(device), index[valid].to(device)))
        c0 += l
    return Plan(torch.tensor(order, dtype=torch.long, device=device), blocks)


def gather(x: torch.Tensor, blk: Block) -> torch.Tensor:
    """Packed rows [sum(T), *rest] -> [l, k, *rest]; padding entries are zero."""
    out = x.index_select(0, blk.index.flatten()).view(blk.length, blk.seqs, *x.shape[1:])
    if blk.valid is not None:
        out.masked_fill_(~blk.valid.view(blk.length, blk.seqs, *([1] * (x.dim() - 1))), 0)
    return out


def scatter(dst: torch.Tensor, src: torch.Tensor, blk: Block) -> None:
    """dst [sum(T), *rest] <- the real tokens of src [l, k, *rest] (each row is written once)."""
    if blk.valid is None:
        dst.index_copy_(0, blk.rows, src.reshape(-1, *dst.shape[1:]))
    else:
        dst.index_copy_(0, blk.rows, src[blk.valid])
