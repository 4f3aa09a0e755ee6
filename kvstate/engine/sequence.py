"""One request as the engine tracks it: tokens, progress through the cache, and what it owns (no torch).

The engine does not tell prefill from decode: a sequence has `num_tokens` known tokens (prompt
plus outputs) of which `num_computed_tokens` are already in its cache (KV blocks + state slot).
Each step computes some of the rest; when it catches up, the last logits give the next token.
A prompt prefilled in chunks, a decode step, and the recompute after a preemption (everything
dropped, `num_computed_tokens` back to 0, prompt and outputs prefilled again) are the same rule.
What a request's sampling needs beyond its params (a seeded random generator) is the runner's,
keyed by request id; text is its `detokenizer`'s (incremental, with the stop strings).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvstate.engine.detokenizer import IncrementalDetokenizer
from kvstate.engine.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, owns no cache (new, or preempted)
    RUNNING = "running"  # owns a state slot and KV blocks
    FINISHED = "finished"  # done: see finish_reason ("stop", "length", "abort")
    REJECTED = "rejected"  # malformed or too long: see error; never scheduled


@dataclass(eq=False)  # a request is itself: compared and hashed by identity
class Sequence:
    request_id: object
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    group: object = None  # the client request it belongs to: admission takes groups in turn (fair_queue)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV and state are in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    state_slot: int | None = None  # state slot id while running
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the request was rejected
    output_logprobs: list = field(default_factory=list)  # what the sampler returned per token
    # with params.prompt_logprobs: [None, {token: Logprob}, ...] for the prompt positions scored so far
    prompt_logprobs: list | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the scheduler when it has a decoder
    # metrics (clock of the scheduler)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # speculative decoding: the drafts proposed for the next step; totals drafted and accepted
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # prefix caching: positions where the request asks for a state snapshot -> kind ("chat": a chat
    # message ends there; "prefix": the caller's cache_prefix), see kvstate.engine.prefix_admission
    snapshot_hints: dict[int, str] = field(default_factory=dict)
    cache_salt: str | None = None  # shares cached blocks and snapshots only with requests of the same salt
    cache_report: object = None  # kvstate.engine.cache_report.CacheReport, set at first admission

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_remaining_tokens(self) -> int:
        """Known tokens not yet in the cache (1 for a decode step)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def prompt_logprobs_missing(self) -> bool:
        """Whether prompt positions are still to be scored (such a prefill cannot skip them: no prefix cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs or [None]) < self.num_prompt_tokens

    def prompt_rows(self, start: int, n: int) -> range:
        """Of the tokens [start, start + n) computed in a step, the positions whose logits score a
        prompt token not yet scored (position r scores token r + 1); empty when none is asked for."""
        if self.params.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs or [None]) - 1)
        return range(first, max(first, min(start + n, self.num_prompt_tokens - 1)))

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Prompt positions first, first + 1, ... scored (index p holds position p's entry; 0 is None)."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if first == len(self.prompt_logprobs):  # a recompute after preemption has them already
            self.prompt_logprobs.extend(entries)

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + outputs, without building the whole list."""
        p = len(self.prompt_token_ids)
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.REJECTED)

    @property
    def output_text(self) -> str | None:
        """The output decoded so far (ending before the stop string that ended it); None without a decoder."""
        return None if self.detokenizer is None else self.detokenizer.text

    # metrics -----------------------------------------------------------------------------
    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first output token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first (None with fewer than 2)."""
        n = self.num_output_tokens
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def metrics(self) -> dict[str, float | int | None]:
        return {"time_to_first_token": self.time_to_first_token,
                "time_per_output_token": self.time_per_output_token,
                "latency": self.latency,
                "num_prompt_tokens": self.num_prompt_tokens,
                "num_output_tokens": self.num_output_tokens,
                "num_preemptions": self.num_preemptions,
                "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens}
