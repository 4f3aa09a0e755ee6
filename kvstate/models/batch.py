"""The metadata of one forward step, passed explicitly to the model (no hidden globals).

A step runs a packed batch of N entries (sequences): entry i contributes `query_lens[i]` new
tokens after `context_lens[i]` tokens already in its cache. Attention layers find their KV
through `block_tables` (paged blocks of `block_size` tokens) and write new K/V at `kv_indices`;
linear layers read and write their recurrent and conv state at `state_slots` (a "slot" is only
ever a state slot).

Each entry has a mode, set once by whoever builds the batch (the runner; by default "decode" for
one new token, else "prefill"): linear mixers run the recurrent op on decode entries and the chunk
op on prefill entries (`groups`, see `kvstate.layers.recurrence`). "verify" entries (speculative
decoding: the last known token and k drafts) run the recurrent op keeping the state after every
token; the linear layers leave those states in `rollback` and the engine keeps the one at the
accepted length once it is known (`kvstate.layers.recurrence.keep_states`). Attention treats a
verify entry as a prefill chunk.

`BatchLayout` is a step as plain host lists (what the engine hands over, and what crosses to TP
ranks); `Batch.from_layout` builds from it. Host-side lengths are plain lists computed once; every
tensor lives on the model's device (`Batch.build(..., device=)`). The model returns logits only
for `sample_rows`: the last token of the entries whose next token is sampled (every token of a
verify entry: each row judges one draft), or with logits="all" every token, for tests/analysis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from bisect import bisect_right
from itertools import accumulate

import torch

MODES = ("prefill", "decode", "verify")


@dataclass(frozen=True)
class StateGroup:
    """The entries of a step that run through one op of a linear mixer (all of one mode)."""

    mode: str  # "prefill" | "decode" | "verify"
    entries: list[int]  # entry indices, in batch order
    rows: slice | torch.Tensor  # their packed token rows: a slice when contiguous, else [T_g] int64
    num_tokens: int
    cu_seqlens: torch.Tensor  # [n + 1] int64, packed offsets within the group's tokens
    slots: torch.Tensor  # [n] int64, state slot of each entry
    fresh_slots: torch.Tensor | None  # [f] int64, slots of entries with an empty cache (start from zeros)


@dataclass(frozen=True)
class BatchLayout:
    """One step's entries as host lists (no tensors): the arguments of `Batch.build`, by name."""

    query_lens: list[int]  # new tokens per entry
    context_lens: list[int]  # tokens cached before this step
    state_slots: list[int]
    block_tables: list[list[int]]
    block_size: int
    modes: list[str] | None = None  # None: "decode" for one new token, else "prefill"
    sample_rows: list[int] | None = None  # None: every entry
    captures: list[tuple[int, int, int]] | None = None  # (prefill entry, k, slot): its state after k tokens


@dataclass
class Batch:
    query_lens: list[int]  # host: new tokens per entry
    context_lens: list[int]  # host: tokens cached before this step
    kv_lens: list[int]  # host: context + new tokens
    token_offsets: list[int]  # host: [N + 1] packed offsets (cu_seqlens as a list)
    modes: list[str]  # per entry, one of MODES
    cu_seqlens: torch.Tensor  # [N + 1] int64
    positions: torch.Tensor  # [T] int64, absolute position of every new token
    state_slots: torch.Tensor  # [N] int64, state slot of each entry
    block_tables: torch.Tensor  # [N, max_blocks] int64, KV block ids (-1 past the end)
    kv_indices: torch.Tensor  # [T] int64, flat KV row (block * block_size + offset) of each new token
    block_size: int
    logits_indices: torch.Tensor  # [M] int64, packed rows whose logits the model returns
    groups: tuple[StateGroup, ...]  # one per mode present, decode first
    # a step of decode and verify entries only (speculative decoding), as one "verify" group of every
    # entry and the block table of every token [T, max_blocks]: each token is then one query of the
    # per-token kernels (`kernels.decode.gdn_verify`, `attention_decode`). None otherwise.
    verify_group: StateGroup | None = None
    token_tables: torch.Tensor | None = None
    # verify groups' per-token states, filled by the linear layers during the forward:
    # (pool, group, states [T_g, *row]) per layer; see kvstate.layers.recurrence.keep_states
    rollback: list = field(default_factory=list)
    # prefill entry -> [(k, slot)]: the linear layers also write the state after the entry's first k
    # tokens into `slot` (prefix caching's snapshots inside a chunk, kvstate.ops.states_at)
    captures: dict[int, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.token_offsets[-1]

    @property
    def decode_only(self) -> bool:
        """Every entry is a decode (one token through the recurrent op / the absorbed MLA form)."""
        return all(m == "decode" for m in self.modes)

    def decode_at(self, rows: list[int]) -> "Batch":
        """A decode-only step of one token at each of this step's token `rows` (sorted, distinct): the
        same positions, KV rows, block tables and state slots, sliced from this step's tensors. For a
        drafter that runs at positions the target just computed (the MTP head keeps its KV at them):
        equal to `Batch.build` of that step, without rebuilding it."""
        n = len(rows)
        entries = [bisect_right(self.token_offsets, r) - 1 for r in rows]
        context = [self.context_lens[e] + r - self.token_offsets[e] for e, r in zip(entries, rows)]
        device = self.positions.device
        if n == 1:  # views, no index tensors
            pick_rows, pick_entries = slice(rows[0], rows[0] + 1), slice(entries[0], entries[0] + 1)
        else:
            pick_rows = torch.tensor(rows, dtype=torch.int64, device=device)
            pick_entries = torch.tensor(entries, dtype=torch.int64, device=device)
        tables = self.token_tables[pick_rows] if self.token_tables is not None else self.block_tables[pick_entries]
        slots = self.state_slots[pick_entries]
        cu = torch.arange(n + 1, device=device)
        fresh = [j for j, c in enumerate(context) if c == 0]
        fresh_slots = None if not fresh else slots if len(fresh) == n else \
            slots.index_select(0, torch.tensor(fresh, dtype=torch.int64, device=device))
        group = StateGroup("decode", list(range(n)), slice(0, n), n, cu, slots, fresh_slots)
        return Batch(query_lens=[1] * n, context_lens=context, kv_lens=[c + 1 for c in context],
                     token_offsets=list(range(n + 1)), modes=["decode"] * n, cu_seqlens=cu,
                     positions=self.positions[pick_rows], state_slots=slots, block_tables=tables,
                     kv_indices=self.kv_indices[pick_rows], block_size=self.block_size, logits_indices=cu[:n],
                     groups=(group,))

    @classmethod
    def from_layout(cls, layout: BatchLayout, *, device=None) -> "Batch":
        lay = layout
        return cls.build(lay.query_lens, lay.context_lens, lay.state_slots, lay.block_tables, lay.block_size,
                         sample_rows=lay.sample_rows, modes=lay.modes, device=device, captures=lay.captures)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], state_slots: list[int],
              block_tables: list[list[int]], block_size: int, *, sample_rows: list[int] | None = None,
              logits: str = "last", modes: list[str] | None = None, device=None,
              captures: list[tuple[int, int, int]] | None = None) -> "Batch":
        """Assemble the step from host lists. `sample_rows`: the entries whose last token's logits are
        returned (default: every entry with a token); logits="all": every token's (not with sample_rows).
        `modes`: per entry (default: "decode" for one new token, else "prefill"). `captures`: (entry, k,
        slot) where a prefill entry's state after its first k tokens is also written."""
        n = len(query_lens)
        if not (len(context_lens) == len(state_slots) == len(block_tables) == n):
            raise ValueError("query_lens, context_lens, state_slots and block_tables must have one entry per sequence")
        for q, c, table in zip(query_lens, context_lens, block_tables):
            if len(table) * block_size < c + q:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {c + q} tokens")
        modes = list(modes) if modes is not None else ["decode" if q == 1 else "prefill" for q in query_lens]
        if len(modes) != n or any(m not in MODES for m in modes):
            raise ValueError(f"modes must give one of {MODES} per entry, got {modes}")
        if any(m == "decode" and q != 1 for m, q in zip(modes, query_lens)):
            raise ValueError("a decode entry computes exactly one token")
        offsets = [0, *accumulate(query_lens)]
        # the index arithmetic on host lists, one tensor each at the end: a decode step's dozen small
        # torch ops cost more than its whole model forward on a small model (kvstate-phonebook-hybrid)
        as_t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        to = lambda t: t if device is None else t.to(device, non_blocking=True)  # noqa: E731

        width = max(1, max((len(t) for t in block_tables), default=0))
        padded = [list(t) + [-1] * (width - len(t)) for t in block_tables]
        tables = as_t(padded).view(n, width)
        cu = as_t(offsets)
        entry = [i for i, q in enumerate(query_lens) for _ in range(q)]  # [T] entry of each token
        pos = [c + j for q, c in zip(query_lens, context_lens) for j in range(q)]
        positions = as_t(pos)
        kv_indices = as_t([padded[i][p // block_size] * block_size + p % block_size for i, p in zip(entry, pos)])

        if logits == "all":
            if sample_rows is not None:
                raise ValueError("sample_rows selects last-token rows; it does not go with logits='all'")
            rows = list(range(offsets[-1]))
        elif logits == "last":
            wanted = range(n) if sample_rows is None else sample_rows
            rows = [r for i in wanted if query_lens[i] > 0
                    for r in (range(offsets[i], offsets[i + 1]) if modes[i] == "verify" else [offsets[i + 1] - 1])]
        else:
            raise ValueError(f"logits must be 'last' or 'all', got {logits!r}")
        slots = to(as_t(state_slots))
        groups = tuple(_group(mode, [i for i in range(n) if modes[i] == mode], query_lens, context_lens,
                              offsets, slots, to)
                       for mode in ("decode", "prefill", "verify") if mode in modes)
        by_entry: dict[int, list[tuple[int, int]]] = {}
        for e, k, slot in captures or ():
            if modes[e] != "prefill" or not 0 < k < query_lens[e]:
                raise ValueError(f"capture ({e}, {k}, {slot}): needs a prefill entry and 0 < k < its "
                                 f"{query_lens[e]} tokens")
            by_entry.setdefault(e, []).append((k, slot))
        verify_group = token_tables = None
        if "verify" in modes and "prefill" not in modes:
            verify_group = groups[0] if len(groups) == 1 else \
                _group("verify", list(range(n)), query_lens, context_lens, offsets, slots, to)
            token_tables = to(as_t([padded[i] for i in entry]).view(len(entry), width))
        return cls(query_lens=list(query_lens), context_lens=list(context_lens),
                   kv_lens=[c + q for c, q in zip(context_lens, query_lens)], token_offsets=offsets, modes=modes,
                   cu_seqlens=to(cu), positions=to(positions), state_slots=slots, block_tables=to(tables),
                   kv_indices=to(kv_indices), block_size=block_size, logits_indices=to(as_t(rows)), groups=groups,
                   verify_group=verify_group, token_tables=token_tables,
                   captures={e: sorted(c) for e, c in by_entry.items()})


def _group(mode: str, entries: list[int], query_lens, context_lens, offsets, slots, to) -> StateGroup:
    """The group of `entries`; their token rows are a slice when they are consecutive in the batch."""
    lens = [query_lens[i] for i in entries]
    if entries == list(range(entries[0], entries[-1] + 1)):
        rows: slice | torch.Tensor = slice(offsets[entries[0]], offsets[entries[-1] + 1])
    else:
        rows = to(torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in entries]))
    whole = len(entries) == len(query_lens)
    group_slots = slots if whole else slots.index_select(0, to(torch.tensor(entries, dtype=torch.int64)))
    fresh = [j for j, i in enumerate(entries) if context_lens[i] == 0]
    fresh_slots = None if not fresh else group_slots if len(fresh) == len(entries) else \
        group_slots.index_select(0, to(torch.tensor(fresh, dtype=torch.int64)))
    return StateGroup(mode, entries, rows, sum(lens), to(torch.tensor([0, *accumulate(lens)], dtype=torch.int64)),
                      group_slots, fresh_slots)
