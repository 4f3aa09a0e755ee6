"""Drafting with a smaller model of the same vocabulary, which keeps its own cache per request.

The draft model has its own pools (a `ModelRunner`), block ids and two state slots per request:
`slot` holds its state after the request's real tokens (`done` of them), `scratch` is where it
drafts. Each step, per request: the tokens the target accepted since the last step are run
through `slot` (one batched forward for every request; its argmax is draft 1), then `slot` is
copied to `scratch` and drafts 2..k are decoded greedily there (KV written past `done`). The
drafts never touch `slot` and their KV lies past `done`, so whatever the target rejects is
simply overwritten next step: the rollback of a hybrid draft model is the copy, not a recompute.
Greedy drafts are one-hot, which the rejection sampler assumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstate.engine.block_manager import BlockManager, SlotManager
from kvstate.engine.speculative.drafter import Drafter
from kvstate.errors import KvstateError
from kvstate.models.batch import Batch


@dataclass
class _Held:
    slot: int
    scratch: int
    table: list[int] = field(default_factory=list)
    done: int = 0  # the request's tokens in `slot` and in the KV blocks


def draft_pool_bytes(spec, *, max_num_seqs: int, block_size: int, k: int) -> tuple[int, int]:
    """(fixed bytes, bytes per target token) of a draft model's pools, `spec` its cache spec: two state
    slots per request, and KV for every token the target holds plus each request's drafts and a block.
    The engine takes this out of --cache-memory before sizing the target's pools (no torch)."""
    kv_tokens = max_num_seqs * (k + block_size) + block_size
    fixed = 2 * max_num_seqs * spec.state_bytes + kv_tokens * spec.kv_bytes_per_token
    return fixed, spec.kv_bytes_per_token


class DraftModelDrafter(Drafter):
    def __init__(self, model, plan, *, max_num_seqs: int, block_size: int, kv_capacity_tokens: int, k: int,
                 max_model_len: int | None = None):
        """`kv_capacity_tokens`: the most tokens held at once by all requests (the target's KV capacity);
        `max_model_len`: the most one request holds (the target's; None: all of the capacity)."""
        from kvstate.cache.spec import cache_spec
        from kvstate.engine.runner import ModelRunner

        spec = cache_spec(plan, kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
        slots = 2 * max_num_seqs
        # one request's length, drafts and a block included: a draft without KV layers keeps block ids for
        # that many tokens per slot (the capacity of all requests per slot would be billions of ids)
        longest = min(kv_capacity_tokens, max_model_len or kv_capacity_tokens)
        tokens = longest + k + block_size
        fixed, per_token = draft_pool_bytes(spec, max_num_seqs=max_num_seqs, block_size=block_size, k=k)
        budget = fixed + kv_capacity_tokens * per_token
        self.runner = ModelRunner(model, plan, cache_bytes=budget, block_size=block_size, num_slots=slots,
                                  max_model_len=tokens)
        self.blocks = BlockManager(self.runner.sizes.num_blocks, block_size)
        self.slots = SlotManager(slots)
        self.held: dict[object, _Held] = {}

    @classmethod
    def load(cls, path, core, k: int) -> "DraftModelDrafter":
        from kvstate.models.loader import load_model

        model, plan = load_model(path)
        if plan.vocab_size != core.plan.vocab_size:
            raise KvstateError(f"speculative_config: the draft model's vocabulary ({plan.vocab_size}) is not the "
                               f"target's ({core.plan.vocab_size})")
        cfg = core.scheduler.config
        return cls(model, plan, max_num_seqs=cfg.max_num_seqs, block_size=cfg.block_size,
                   kv_capacity_tokens=cfg.num_blocks * cfg.block_size, k=k, max_model_len=cfg.max_model_len)

    def release(self, seq) -> None:
        h = self.held.pop(seq, None)
        if h is not None:
            self.blocks.free(h.table)
            self.slots.free(h.slot)
            self.slots.free(h.scratch)

    def _hold(self, seq, k: int) -> _Held | None:
        """seq's draft cache, with blocks for its tokens and k - 1 drafts; None where the pools are full."""
        h = self.held.get(seq)
        if h is None:
            if not self.slots.can_allocate(2):
                return None
            h = self.held[seq] = _Held(self.slots.allocate(), self.slots.allocate())
        if not self.blocks.can_grow(h.table, seq.num_tokens + k - 1):
            self.release(seq)
            return None
        self.blocks.grow(h.table, seq.num_tokens + k - 1)
        return h

    @torch.inference_mode()
    def propose(self, requests: list[tuple[object, int]]) -> list[list[int]]:
        """requests: (sequence, most drafts wanted) -> greedy drafts of the draft model."""
        drafts: list[list[int]] = [[] for _ in requests]
        live = [(j, seq, k, h) for j, (seq, k) in enumerate(requests) if (h := self._hold(seq, k)) is not None]
        if not live:
            return drafts
        # 1: catch up with the real tokens in `slot`; the last one's argmax is the first draft
        ids = [t for _, seq, _, h in live for t in seq.token_ids(h.done, seq.num_tokens)]
        first = self._forward(ids, [seq.num_tokens - h.done for _, seq, _, h in live], [h.done for *_, h in live],
                              [h.slot for *_, h in live], [h.table for *_, h in live])
        for (j, seq, _, h), t in zip(live, first):
            h.done = seq.num_tokens
            drafts[j].append(t)
        # 2: the rest one at a time in `scratch`, a copy of `slot`
        self.runner.copy_slots([(h.slot, h.scratch) for *_, h in live])
        for step in range(1, max(k for _, _, k, _ in live)):
            more = [(j, seq, h) for j, seq, k, h in live if k > step]
            nxt = self._forward([drafts[j][-1] for j, _, _ in more], [1] * len(more),
                                [h.done + step - 1 for *_, h in more], [h.scratch for *_, h in more],
                                [h.table for *_, h in more])
            for (j, _, _), t in zip(more, nxt):
                drafts[j].append(t)
        return drafts

    def _forward(self, ids, query_lens, context_lens, slots, tables) -> list[int]:
        device = self.runner.model.device
        batch = Batch.build(query_lens, context_lens, slots, tables, self.runner.block_size, device=device)
        logits = self.runner.model(torch.tensor(ids, dtype=torch.int64, device=device), batch, self.runner.caches)
        return logits.argmax(dim=-1).tolist()
