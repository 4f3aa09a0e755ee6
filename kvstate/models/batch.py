"""The metadata of one forward step, passed explicitly to the model (no hidden globals).

A step runs a packed batch of N sequences: each contributes `query_lens[i]` new tokens after
`context_lens[i]` tokens already in its cache. Attention layers find their KV through
`block_tables` (paged blocks of `block_size` tokens) and write new K/V at `slot_mapping`;
linear layers read and write their recurrent and conv state at `state_slots`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Batch:
    cu_seqlens: torch.Tensor  # [N + 1] int64, packed offsets of the new tokens
    positions: torch.Tensor  # [T] int64, absolute position of every new token
    context_lens: torch.Tensor  # [N] int64, tokens cached before this step
    state_slots: torch.Tensor  # [N] int64, state slot of each sequence
    block_tables: torch.Tensor  # [N, max_blocks] int64, KV block ids (-1 past the end)
    slot_mapping: torch.Tensor  # [T] int64, flat KV row (block * block_size + offset) of each new token
    block_size: int
    logits_indices: torch.Tensor  # [M] int64, packed rows whose logits are returned
    query_lens: list[int] = field(default_factory=list)  # host copies for the python loops
    kv_lens: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def decode_only(self) -> bool:
        """Every sequence adds exactly one token: linear layers take the recurrent (decode) path."""
        return all(q == 1 for q in self.query_lens)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], state_slots: list[int],
              block_tables: list[list[int]], block_size: int, *, logits: str = "last") -> "Batch":
        """Assemble the tensors from host lists. `logits`: "last" (one row per sequence) or "all"."""
        n = len(query_lens)
        if not (len(context_lens) == len(state_slots) == len(block_tables) == n):
            raise ValueError("query_lens, context_lens, state_slots and block_tables must have one entry per sequence")
        cu = [0]
        positions: list[int] = []
        slot_mapping: list[int] = []
        for q, c, table in zip(query_lens, context_lens, block_tables):
            if len(table) * block_size < c + q:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {c + q} tokens")
            cu.append(cu[-1] + q)
            for p in range(c, c + q):
                positions.append(p)
                slot_mapping.append(table[p // block_size] * block_size + p % block_size)
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.full((n, max(width, 1)), -1, dtype=torch.int64)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        if logits == "last":
            rows = [cu[i + 1] - 1 for i in range(n) if query_lens[i] > 0]
        elif logits == "all":
            rows = list(range(cu[-1]))
        else:
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return cls(cu_seqlens=as_t(cu), positions=as_t(positions), context_lens=as_t(context_lens),
                   state_slots=as_t(state_slots), block_tables=tables, slot_mapping=as_t(slot_mapping),
                   block_size=block_size, logits_indices=as_t(rows), query_lens=list(query_lens),
                   kv_lens=[c + q for c, q in zip(context_lens, query_lens)])
