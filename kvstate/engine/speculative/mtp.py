"""Drafting with the checkpoint's own multi-token-prediction head (`model.mtp`; docs/mtp.md).

The head's attention keeps its KV in the engine's pools (the cache spec's layer after the
decoder's, `cache_spec(mtp=True)`), in the target's own KV blocks at the target's positions: no
second block manager, and the scheduler's trimming of rejected drafts' blocks trims the head's
too. What the draft-model drafter does with its `done` counter holds here per position: the
head's KV at position p is written from the target's hidden state h_p and the token at p + 1.

- `after_step(result)`, after every step's postprocess: for each entry, the positions p the target
  just computed whose next token is now known (prompt chunks, the accepted part of a verify,
  a decode) run through the head in one batched forward, h_p from the step's hidden states
  (`result.hidden`, which the runner keeps because `wants_hidden`). This
  overwrites whatever a previous step's chained drafts wrote there (their KV was computed from
  the head's own output, not h_p): the rollback is this rewrite, before any later read.
  The row at the last known position (p = n - 2) gives draft 1.
  A sequence that resumed at p from a prefix-cache snapshot (`step.resumed`) first gets the head's
  row p - 1 rewritten from h_{p-1} (which the runner keeps with every state slot: `result.hidden.resumed`)
  and its own token at p: the row in the shared or copied block was written for the tokens of
  the request that left the snapshot, which may go on differently there.
- `propose`: drafts 2..k chain on the head's own output y at positions n - 1, n, ... in blocks
  grown now for the verify that comes next (where the pool has none, only draft 1).
Greedy drafts are one-hot, which the rejection sampler assumes.
"""

from __future__ import annotations

import contextlib
from itertools import accumulate

import torch

from kvstate.engine.sequence import SequenceStatus
from kvstate.engine.speculative.drafter import Drafter, StepResult
from kvstate.kernels.threads import small_ops_serial
from kvstate.models import decode_blocks
from kvstate.models.batch import Batch
from kvstate.profiling import timed


SHORT = 16  # entries of at most this many tokens run through the per-token attention kernel


class MtpDrafter(Drafter):
    wants_hidden = True

    def __init__(self, runner, blocks):
        """`runner`: the engine's ModelRunner built with mtp=True; `blocks`: the scheduler's BlockManager."""
        self.runner, self.blocks = runner, blocks
        self.model = runner.model
        # looked up once: Module attribute lookups are slow, and the drafter runs cold after the kernels
        self.head, self.embed, self.lm_head = self.model.mtp, self.model.embed_tokens, self.model.lm_head
        self.device = self.model.device
        self.cache = runner.caches[-1]  # the head's KV pools: the cache spec's last layer
        self.ready: dict[object, tuple[int, int, torch.Tensor]] = {}  # seq -> (num_tokens, draft 1, y [1, H])
        self.pending: tuple | None = None  # batch 1: after_step's compiled head call, run by the propose after it

    def release(self, seq) -> None:
        self.ready.pop(seq, None)
        if self.pending is not None and self.pending[0] is seq:
            self.pending = None

    @timed("drafter")
    @torch.inference_mode()
    def after_step(self, result: StepResult) -> None:
        """Run the head over the positions of the step whose next token is known (see the module docstring)."""
        if self.pending is not None:  # no propose ran since the last after_step: its KV rows first
            self._settle(self.pending, 0)
            self.pending = None
        step, hidden = result.step, result.hidden
        self._resumed(step, hidden.resumed)
        hb = hidden.batch
        hidden, offsets = hidden.states, hb.token_offsets
        rows, ids, lens, starts, slots, tables, live = [], [], [], [], [], [], []
        for i, (seq, c, q) in enumerate(zip(step.seqs, step.context_lens, step.num_tokens)):
            end = min(c + q, seq.num_tokens - 1)  # positions c .. end - 1 have h and a next token
            running = seq.status is SequenceStatus.RUNNING
            # a reply that just finished still holds its blocks while its end snapshot is taken (prefix
            # caching): its last rows are rewritten too, or a later request resuming there reads the
            # KV the chained drafts left in them
            if end <= c or not (running or seq.block_table):
                continue
            rows.extend(range(offsets[i], offsets[i] + end - c))
            ids.extend(seq.token_ids(c + 1, end + 1))
            lens.append(end - c)
            starts.append(c)
            slots.append(seq.state_slot)
            tables.append(seq.block_table)
            live.append((seq, running and end == seq.num_tokens - 1))
        if not live:
            return
        device = self.device
        if rows[-1] - rows[0] == len(rows) - 1:  # consecutive rows (batch 1): a view
            h = hidden[rows[0] : rows[-1] + 1]
        else:
            h = hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=device))
        compiled = self._compiled() if len(lens) == 1 and lens[0] <= SHORT else None
        if compiled is not None and live[0][1]:  # batch 1 after a decode or verify step: see `propose`
            self.ready.pop(live[0][0], None)
            self.pending = (live[0][0], compiled, ids, h, starts[0])  # plain ints: the call makes its rows
            return
        if max(lens) <= SHORT:  # decode and verify steps: each position one query row, sliced from the step
            tokens, y = self._run(ids, h, hb.decode_at(rows))  # drafts of every row
        else:
            tokens, y = self._forward(ids, h, lens, starts, slots, tables)
        if len(lens) == 1:  # batch 1: its last row, as a view
            ys, tokens = y[-1:], tokens[-1:]
        elif len(rows) != len(lens):  # each entry's last row
            last = torch.tensor(list(accumulate(lens)), device=device) - 1
            ys = y.index_select(0, last)
            tokens = tokens if tokens.shape[0] == len(lens) else tokens.index_select(0, last)
        else:
            ys = y
        for j, ((seq, at_end), t) in enumerate(zip(live, tokens.tolist())):
            if at_end:
                self.ready[seq] = (seq.num_tokens, t, ys[j : j + 1])  # y [1, H]
            else:
                self.ready.pop(seq, None)

    def _resumed(self, step, got: dict) -> None:
        """Rewrite the head's row p - 1 of each entry that resumed at p from a snapshot (see the module
        docstring); `got`: entry -> h_{p-1} [H]."""
        live = [(i, seq, c) for i in getattr(step, "resumed", ()) if i in got
                for seq, c in [(step.seqs[i], step.context_lens[i])] if seq.status is SequenceStatus.RUNNING]
        if not live:
            return
        ids = [seq.token_ids(c, c + 1)[0] for _, seq, c in live]
        h = torch.stack([got[i] for i, _, _ in live])  # [N, H]
        self._forward(ids, h, [1] * len(live), [c - 1 for *_, c in live], [seq.state_slot for _, seq, _ in live],
                      [seq.block_table for _, seq, _ in live])

    @timed("drafter")
    @torch.inference_mode()
    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """requests: (sequence, most drafts wanted) -> the head's greedy drafts."""
        drafts: list[list[int]] = [[] for _ in requests]
        pending, self.pending = self.pending, None
        if pending is not None:  # after_step's rows, then the whole chain, as one compiled call
            j = next((j for j, (s, _) in enumerate(requests) if s is pending[0]), None)
            got = self._settle(pending, 0 if j is None else requests[j][1])
            if j is not None:
                drafts[j] = got
        chain = []  # (j, seq, k, y) of requests that get more than one draft
        for j, (seq, k) in enumerate(requests):
            if pending is not None and seq is pending[0]:
                continue
            got = self.ready.get(seq)
            if got is None or got[0] != seq.num_tokens:
                continue
            drafts[j].append(got[1])
            # draft i (i >= 2) writes the head's KV at position n + i - 3: blocks the next verify needs anyway
            if k > 1 and self.blocks.can_grow(seq.block_table, seq.num_tokens + k - 2):
                self.blocks.grow(seq.block_table, seq.num_tokens + k - 2)
                chain.append((j, seq, k, got[2]))
        compiled = self._compiled() if chain and len({k for _, _, k, _ in chain}) == 1 else None
        if compiled is not None:  # the whole chain as one compiled call
            n = [seq.num_tokens for _, seq, _, _ in chain]
            width = max(len(seq.block_table) for _, seq, _, _ in chain)
            device = self.device
            ys = chain[0][3] if len(chain) == 1 else torch.cat([c[3] for c in chain])  # [N, H]
            with self._serial():
                out = decode_blocks.chain_head(
                    compiled, torch.tensor([drafts[j][0] for j, *_ in chain], device=device), ys, self.cache,
                    torch.tensor([m - 1 for m in n], device=device),
                    torch.tensor([list(seq.block_table) + [-1] * (width - len(seq.block_table))
                                  for _, seq, _, _ in chain], device=device),
                    self.runner.block_size, chain[0][2] - 1, sum(n)).tolist()
            for (j, *_), more in zip(chain, out):
                drafts[j].extend(more)
            return drafts
        for step in range(1, max((k for _, _, k, _ in chain), default=1)):
            chain = [c for c in chain if c[2] > step]
            n = [seq.num_tokens for _, seq, _, _ in chain]
            ys = chain[0][3] if len(chain) == 1 else torch.cat([c[3] for c in chain])  # [N, H]
            tokens, y = self._forward([drafts[j][-1] for j, *_ in chain], ys, [1] * len(chain),
                                      [m + step - 2 for m in n], [seq.state_slot for _, seq, _, _ in chain],
                                      [seq.block_table for _, seq, _, _ in chain])
            for (j, *_), t in zip(chain, tokens.tolist()):
                drafts[j].append(t)
            chain = [(j, seq, k, y[r : r + 1]) for r, (j, seq, k, _) in enumerate(chain)]
        return drafts

    def _forward(self, ids, hidden, query_lens, context_lens, slots, tables):
        """One batched forward of the head: (greedy draft of each entry's last token [N], y [T, H]). A few
        tokens per entry (a verify's accepted ones) run as "verify" entries, whose attention takes the
        per-token decode kernel (the head has no recurrent state to keep); long prompt chunks as prefill."""
        device = self.device
        modes = ["decode" if q == 1 else "verify" if q <= SHORT else "prefill" for q in query_lens]
        batch = Batch.build(query_lens, context_lens, slots, tables, self.runner.block_size, modes=modes,
                            device=device)
        if "verify" in modes:  # one logits row per entry, its last token's (a verify entry would give all)
            batch.logits_indices = torch.tensor(batch.token_offsets[1:], device=device) - 1
        return self._run(ids, hidden, batch)

    def _settle(self, pending, k: int) -> list[int]:
        """Run the head over the rows after_step left `pending` (one sequence: its KV there, draft 1 from the
        last row), then drafts 2..k chained on it where its blocks can grow: one compiled call."""
        seq, compiled, ids, h, start = pending
        steps = 0
        if k > 1 and self.blocks.can_grow(seq.block_table, seq.num_tokens + k - 2):
            self.blocks.grow(seq.block_table, seq.num_tokens + k - 2)
            steps = k - 1
        return decode_blocks.run_chain_head(compiled, ids, h, self.cache, start, seq.block_table,
                                            self.runner.block_size, steps, self.runner.serial_small_ops)

    def _compiled(self):
        """The head's compiled one-token forward (decode_blocks.compiled_head), or None."""
        return decode_blocks.compiled_head(self.head, self.embed, self.lm_head)

    def _serial(self):
        """The runner's thread policy of a decode step: small ops on one thread, weight streaming on all."""
        return small_ops_serial() if self.runner.serial_small_ops else contextlib.nullcontext()

    def _run(self, ids: list[int], hidden: torch.Tensor, batch):
        """The head's forward over `batch`: (greedy drafts [N], y [T, H])."""
        ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        # the runner's thread policy of a decode step: small ops on one thread, weight streaming on all
        serial = batch.decode_only and self.runner.serial_small_ops
        with small_ops_serial() if serial else contextlib.nullcontext():
            return self.head.draft(ids, hidden, batch, self.cache, self.embed, self.lm_head)
