"""Continuous batching with chunked prefill over paged KV blocks and state slots (no torch).

One engine step is `step = schedule()`, run the model on it, `postprocess(step, tokens)`.
Requests wait in a FIFO queue; running sequences are kept in admission order. `schedule()`
spends a budget of `max_num_batched_tokens` tokens in this order:

1. **Decodes** (running sequences one token behind), oldest first, one token each. A decode
   that needs a new KV block and finds none preempts the most recently admitted running
   sequence not yet scheduled this step, repeatedly; if that is itself, it is preempted.
   With speculative decoding a decode carries its drafts (`seq.spec_token_ids`, as many as the
   blocks and budget allow) as one "verify" entry; `postprocess` appends the accepted ones and
   the token after them and frees the KV blocks past them (`_accept`).
2. **Continuing prefills** (running sequences further behind: a chunked prompt, or a recompute),
   oldest first, as many tokens as the budget allows, cut down to the KV blocks still free. If
   not one token fits, newer unscheduled sequences are preempted; if there are none it waits
   (keeping its cache) for a later step.
3. **Admissions**, only if nothing was preempted this step: the head of the queue starts when a
   state slot is free, fewer than `max_num_seqs` run, and the free blocks hold its first chunk
   (min(prompt, budget left)); otherwise admission stops (no overtaking, so long prompts are not
   starved). The queue (`FairQueue`) takes request groups in turn: one sequence of each client
   request (`add(..., group=)`) at a time, so one request's many prompts and samples cannot starve
   a request sent after it; requests without a group are first come first served. A group running
   its fair share (max_num_seqs / groups running or waiting) is passed over while a group below it
   waits, and when every sequence place is taken, the first step of `schedule` preempts one sequence
   of the group furthest above its share for it (`fair_victim`; admissions resume the next step).

A preempted sequence gives back its blocks and slot, goes to the front of the queue, and is
later recomputed from scratch (prompt + outputs so far; its linear-layer state cannot be cut).
The scheduler decides token counts only: chunked prefill works because the runner carries the
state slot from chunk to chunk.

`postprocess` appends sampled tokens and finishes sequences on: eos (unless ignore_eos),
stop_token_ids, stop strings, max_tokens, or the model's maximum length; their blocks and slot
go back to the pools. With a `detokenize` callable (token ids -> text) every sequence gets an
incremental detokenizer that decodes each new token once and finds stop strings. Malformed or
oversized requests are rejected at `add` (status REJECTED, `error` set) and reported by the next
`postprocess` with the finished ones; the others keep running. The next `schedule()` carries
the ids of the finished requests (the runner drops their sampling state) and the queued
state-slot copies.
"""

from __future__ import annotations

import time
from itertools import islice
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from kvstate.engine.block_manager import BlockManager, SlotManager
from kvstate.engine.detokenizer import IncrementalDetokenizer
from kvstate.engine.fair_queue import FairQueue, fair_shares, fair_victim, group_key
from kvstate.engine.params import SamplingParams
from kvstate.engine.request_check import check_request
from kvstate.engine.scheduler_output import SchedulerOutput
from kvstate.engine.sequence import Sequence, SequenceStatus

RUNNING, WAITING = SequenceStatus.RUNNING, SequenceStatus.WAITING


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV blocks in the pool
    block_size: int  # tokens per KV block
    num_slots: int  # state slots in the pool
    max_model_len: int  # most tokens (prompt + output) a sequence may hold
    vocab_size: int  # valid token ids are [0, vocab_size)
    max_num_seqs: int = 64  # most running sequences
    max_num_batched_tokens: int = 2048  # token budget of one step
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # prefix caching (`kvstate.engine.prefix_cache`, positions in `prefix_admission`): snapshots every
    # `snapshot_interval` tokens ("auto": adapted to the prompt; None: none), at prompt length - 1
    # (`snapshot_repeat`; False: at the prompt end), at the positions a request names, reply ends and
    # branch points, only at multiples of `prefix_align` (1024: vLLM's block-aligned policy, for
    # comparison); `prefix_costs` = (prefill FLOPs per token, per token pair, bytes of a state slot,
    # bytes of a KV block) for the eviction's value per byte
    enable_prefix_caching: bool = False
    snapshot_interval: int | str | None = "auto"
    snapshot_repeat: bool = True
    prefix_eviction: str = "marconi"
    prefix_align: int = 1
    prefix_costs: tuple[float, float, int, int] = (1.0, 0.0, 1, 0)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_slots", "max_model_len", "vocab_size", "max_num_seqs",
                     "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError(f"SchedulerConfig.num_blocks must be >= 0, got {self.num_blocks}")
        object.__setattr__(self, "eos_token_ids", frozenset(self.eos_token_ids))
        if not (self.snapshot_interval in (None, "auto") or (isinstance(self.snapshot_interval, int)
                                                           and self.snapshot_interval >= 1)):
            raise ValueError(f"SchedulerConfig.snapshot_interval must be an integer >= 1, 'auto' or None, "
                             f"got {self.snapshot_interval!r}")


class StepResult(NamedTuple):
    """What `postprocess` recorded: the sequences finished or rejected since the last call, and per
    verify entry the tokens it kept (entry -> count), which the runner's rollback needs."""

    finished: list[Sequence]
    kept: dict[int, int]


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, detokenize: Callable[[list[int]], str] | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.slots = SlotManager(config.num_slots)
        self.detokenize = detokenize  # token ids -> text: output text and stop strings
        self.clock = clock
        self.waiting = FairQueue()  # new requests by group in turn, preempted ones first
        self.running: list[Sequence] = []  # admission order, oldest first
        self._live: dict[object, Sequence] = {}  # request id -> waiting or running sequence
        self._outbox: list[Sequence] = []  # finished or rejected since the last postprocess
        self._finished_ids: list[object] = []  # finished since the last schedule (for the runner)
        self._pending: SchedulerOutput | None = None
        self.prefix = None  # PrefixHooks when prefix caching is on
        self._flushing: list[Sequence] = []  # finished; one more entry computes the last token, then a snapshot
        if config.enable_prefix_caching:
            from kvstate.engine.prefix_admission import PrefixHooks
            from kvstate.engine.prefix_cache import PrefixCache

            a, b, slot_bytes, block_bytes = config.prefix_costs
            cache = PrefixCache(self.blocks, self.slots, policy=config.prefix_eviction, flops_per_token=a,
                                flops_per_token_pair=b, slot_bytes=slot_bytes, block_bytes=block_bytes,
                                align=config.prefix_align, clock=clock)
            self.prefix = PrefixHooks(cache, interval=config.snapshot_interval, repeat=config.snapshot_repeat)

    # requests ------------------------------------------------------------------------------
    def add(self, request_id, prompt_token_ids, params: SamplingParams | None = None, *,
            arrival_time: float | None = None, group=None,
            snapshot_hints: dict[int, str] | None = None, refuse: str | None = None,
            cache_salt: str | None = None) -> Sequence:
        """Queue a request. A malformed one comes back REJECTED with `error` set (no exception), as
        does one the caller `refuse`s (the reason).
        `group`: the client request it belongs to (admission takes groups in turn); None: its own.
        `snapshot_hints`: prompt positions -> kind where prefix caching should keep a state snapshot
        (positions outside [1, prompt length] are left out). `cache_salt`: cached blocks and snapshots are
        shared only between requests with the same salt (None: today's shared cache)."""
        now = self.clock() if arrival_time is None else arrival_time
        params = SamplingParams() if params is None else params
        tokens, error = check_request(self.config, self.blocks.blocks_for, request_id, prompt_token_ids, params,
                                      in_use=request_id in self._live, can_detokenize=self.detokenize is not None)
        error = error or refuse
        if error is None and cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            error = f"cache_salt must be a non-empty string, got {cache_salt!r:.40}"
        seq = Sequence(request_id, tokens, params, arrival_time=now, group=group,
                       cache_salt=cache_salt if isinstance(cache_salt, str) else None)
        if snapshot_hints and self.prefix is not None and error is None:
            seq.snapshot_hints = {p: k for p, k in snapshot_hints.items() if 1 <= p <= len(tokens)}
        if error is not None:
            seq.status, seq.finish_reason, seq.error, seq.finished_time = SequenceStatus.REJECTED, "error", error, now
            self._outbox.append(seq)
            return seq
        if self.detokenize is not None:
            seq.detokenizer = IncrementalDetokenizer(self.detokenize, params.stop)
        self._live[request_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id) -> bool:
        """Stop a waiting or running request now (finish_reason "abort"); False if unknown."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        if seq.status is WAITING:
            self.waiting.remove(seq)
        self._finish(seq, "abort", None, self.clock())
        return True

    def has_work(self) -> bool:
        """Whether a step is still needed: sequences to run, or results not yet reported."""
        return bool(self.waiting or self.running or self._outbox or self._flushing)

    # scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose this step's (sequence, num_tokens) entries; see the module docstring for the policy."""
        if self._pending is not None:
            raise RuntimeError("schedule() called before postprocess() of the previous step")
        cfg, now = self.config, self.clock()
        step = SchedulerOutput(cfg.block_size)
        budget = cfg.max_num_batched_tokens
        scheduled: set[Sequence] = set()  # the sequences in this step
        budget -= self._schedule_flushes(step, budget, now)
        counts, share = fair_shares(self.running, self.waiting, cfg.max_num_seqs)
        self._yield_fairly(step, counts, share)
        if self.prefix is not None:
            room = cfg.max_num_seqs - len(self.running)  # the waiting requests this step may admit
            self.prefix.protect(islice(self.waiting, room) if self.waiting and room > 0 else ())
        for decodes in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not RUNNING or seq in scheduled or (seq.num_remaining_tokens == 1) != decodes:
                    continue
                # a decode with drafts (speculative decoding) verifies them in the same entry
                want = seq.num_remaining_tokens + (len(seq.spec_token_ids) if decodes else 0)
                n = self._fit(seq, min(want, budget), scheduled, step, preempt_self=decodes)
                if n:
                    step.add(seq, n)
                    if decodes and n > 1:
                        step.add_drafts(seq.spec_token_ids[: n - 1])
                    seq.spec_token_ids = []  # drafts are used once: the proposer drafts anew after the step
                    scheduled.add(seq)
                    budget -= n
        while (not step.preempted and self.waiting and budget and len(self.running) < cfg.max_num_seqs
               and (self.slots.can_allocate() if self.prefix is None else self.prefix.free_slot())):
            seq = self.waiting.pick(counts, share)
            if self.prefix is not None:  # starts from the longest cached prefix (slot and blocks taken)
                n = self.prefix.admit(seq, budget, now, self._flushing, idle=not (self.running or step.seqs))
                if n is None:
                    break
            else:
                n = min(seq.num_remaining_tokens, budget)
                if not self.blocks.can_grow(seq.block_table, n):
                    break
                seq.state_slot = self.slots.allocate()
                self.blocks.grow(seq.block_table, n)
            self.waiting.popleft(seq)
            counts[group_key(seq)] += 1
            seq.status = RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            step.add(seq, n)
            if seq.num_computed_tokens:  # resumed from a prefix-cache snapshot
                step.resumed.append(len(step.seqs) - 1)
            scheduled.add(seq)
            budget -= n
        if self.prefix is not None:  # snapshots inside prefill chunks, once admissions found theirs
            for i, seq in enumerate(step.seqs):
                if i not in step.drafts and step.num_tokens[i] > 1:
                    self.prefix.capture(seq, step, i, now)
            self.prefix.protect(())
        step.slot_copies = self.slots.take_copies()
        step.block_copies = self.blocks.take_copies()
        step.finished_request_ids, self._finished_ids = self._finished_ids, []
        self._pending = step
        return step

    def _yield_fairly(self, step: SchedulerOutput, counts, share: float) -> None:
        """When no sequence place is free and the group next in line runs below its fair share, preempt
        one sequence of the group furthest above it (which blocks this step's admissions, as any
        preemption does: the freed place is taken by the next step's pick)."""
        places = min(self.config.max_num_seqs, self.config.num_slots - len(self._flushing))
        if not self.waiting or len(self.running) < places:
            return
        victim = fair_victim(self.running, counts, share, self.waiting.pick(counts, share))
        if victim is not None:
            counts[group_key(victim)] -= 1
            self._preempt(victim, step)

    def _fit(self, seq: Sequence, n: int, scheduled: set[Sequence], step: SchedulerOutput, *,
             preempt_self: bool) -> int:
        """Grow `seq`'s block table for up to `n` more tokens; returns how many fit (0: not this step)."""
        if self.prefix is not None:  # verify entries end at snapshot positions; snapshots give way to running work
            if preempt_self:
                n = self.prefix.limit(seq, n)
            self.prefix.reclaim(self.blocks.blocks_missing(seq.block_table, seq.num_computed_tokens + n))
        while self.blocks.capacity(seq.block_table) <= seq.num_computed_tokens:
            victim = self._victim(seq, scheduled, preempt_self)
            if victim is None:
                return 0
            self._preempt(victim, step)
            if victim is seq:
                return 0
        n = min(n, self.blocks.capacity(seq.block_table) - seq.num_computed_tokens)
        self.blocks.grow(seq.block_table, seq.num_computed_tokens + n)
        return n

    def _victim(self, seq: Sequence, scheduled: set[Sequence], preempt_self: bool) -> Sequence | None:
        """The most recently admitted running sequence not scheduled this step, newer than `seq`
        (or `seq` itself when `preempt_self` and no newer one is left)."""
        for cand in reversed(self.running):
            if cand is seq:
                return seq if preempt_self else None
            if cand not in scheduled:
                return cand
        return None

    def _preempt(self, seq: Sequence, step: SchedulerOutput) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        if self.prefix is not None:
            self.prefix.release(seq)
        self.blocks.free(seq.block_table)
        if seq.state_slot is not None:
            self.slots.free(seq.state_slot)
            seq.state_slot = None
        seq.num_computed_tokens = 0

    # results -------------------------------------------------------------------------------
    def postprocess(self, step: SchedulerOutput, token_ids: list[int], logprobs: list | None = None
                    ) -> StepResult:
        """Record a step: `token_ids[j]` (and `logprobs[j]`) is the token sampled for entry
        `step.sample_indices[j]`. Returns the sequences finished or rejected since the last call and
        the tokens each verify entry kept."""
        if step is not self._pending:
            raise RuntimeError("postprocess() got a step that is not the one last scheduled")
        rows = step.sample_indices
        if len(token_ids) != len(rows) or (logprobs is not None and len(logprobs) != len(rows)):
            raise ValueError(f"expected {len(rows)} sampled tokens (step.sample_indices), got {len(token_ids)}")
        self._pending = None
        now = self.clock()
        sampled = dict(zip(rows, range(len(rows))))
        kept: dict[int, int] = {}
        for i, (seq, n) in enumerate(step.entries):
            if seq in self._flushing:  # a finished reply's last token is in the cache: keep its end
                self._flushing.remove(seq)
                seq.num_computed_tokens += n
                self._keep_final(seq, now)
                continue
            if seq.status is not RUNNING:  # aborted after scheduling
                continue
            if i in step.drafts:
                kept[i] = self._accept(seq, i, step, token_ids[sampled[i]], now)
                continue
            seq.num_computed_tokens += n
            if self.prefix is not None:
                self.prefix.computed(seq, now)
            j = sampled.get(i)
            if j is None:
                if seq.params.max_tokens == 0 and seq.num_computed_tokens >= seq.num_tokens:
                    self._finish(seq, "length", None, now)  # prompt logprobs only: scored, nothing to generate
                continue
            token = int(token_ids[j])
            seq.output_token_ids.append(token)
            if logprobs is not None:
                seq.output_logprobs.append(logprobs[j])
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            stop = self._stop(seq, token)
            if stop is not None:
                self._finish(seq, *stop, now)
        out, self._outbox = self._outbox, []
        return StepResult(out, kept)

    def _stop(self, seq: Sequence, token: int) -> tuple[str, int | str | None] | None:
        p = seq.params
        if not p.ignore_eos and token in self.config.eos_token_ids:
            return "stop", None
        if token in p.stop_token_set:
            return "stop", token
        if seq.detokenizer is not None and (s := seq.detokenizer.add(token)) is not None:
            return "stop", s  # a token that ends the output by id (above) adds no text, as in vLLM
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length", None
        if seq.num_tokens >= self.config.max_model_len:
            return "length", None
        return None

    def _finish(self, seq: Sequence, reason: str, stop_reason, now: float) -> None:
        if seq.status is RUNNING:
            self.running.remove(seq)
            if self.prefix is not None and reason != "abort" and seq.num_remaining_tokens == 1:
                self._flushing.append(seq)  # keeps slot and blocks for one more entry (`_schedule_flushes`)
            else:
                self._release(seq)
        seq.status, seq.finish_reason, seq.stop_reason, seq.finished_time = (
            SequenceStatus.FINISHED, reason, stop_reason, now)
        if seq.detokenizer is not None:
            seq.detokenizer.finish()
        self._live.pop(seq.request_id, None)
        self._finished_ids.append(seq.request_id)
        self._outbox.append(seq)

    # prefix caching: the end of a finished reply ---------------------------------------------
    def _schedule_flushes(self, step: SchedulerOutput, budget: int, now: float) -> int:
        """Entries computing the last sampled token of finished replies (not sampled from), so their
        snapshot holds the whole conversation; where no block or budget is left, the snapshot is
        kept one token short at once. Returns the tokens spent."""
        spent = 0
        for seq in list(self._flushing):
            if spent < budget and self.blocks.can_grow(seq.block_table, seq.num_tokens):
                self.blocks.grow(seq.block_table, seq.num_tokens)
                step.add(seq, 1, sample=False)
                spent += 1
            else:
                self._flushing.remove(seq)
                self._keep_final(seq, now)
        return spent

    def _keep_final(self, seq: Sequence, now: float) -> None:
        self.prefix.keep_final(seq, now)  # takes the slot over as a snapshot when it is worth keeping
        self._release(seq)

    # speculative decoding: the outcome of a verify entry -------------------------------------
    def _accept(self, seq: Sequence, i: int, step: SchedulerOutput, tokens: list[int], now: float) -> int:
        """Entry i verified seq's last known token and its drafts; `tokens` are the accepted drafts and
        the token sampled after them. They are appended one by one up to a stop; the computed tokens
        are those before the last appended one, and the KV blocks past them (rejected drafts) are
        freed. Returns how many of this entry's tokens were kept (for the runner's rollback of the
        linear layers)."""
        start = seq.num_computed_tokens
        seq.num_draft_tokens += len(step.drafts[i])
        seq.num_accepted_tokens += len(tokens) - 1
        stop = None
        for t, token in enumerate(tokens):
            seq.num_computed_tokens = start + 1 + t
            seq.output_token_ids.append(int(token))
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            stop = self._stop(seq, int(token))
            if stop is not None:
                break
        kept = seq.num_computed_tokens - start
        if self.prefix is not None:
            self.prefix.computed(seq, now)
        extra = seq.block_table[self.blocks.blocks_for(seq.num_computed_tokens):]
        del seq.block_table[len(seq.block_table) - len(extra):]
        self.blocks.free(extra)
        if stop is not None:
            self._finish(seq, *stop, now)
        return kept
