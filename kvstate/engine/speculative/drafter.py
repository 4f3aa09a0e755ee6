"""What speculative decoding asks of a drafter, and what each engine step hands it (no torch).

A drafter proposes tokens; the engine verifies them. Every method is named here, the optional
ones with a default body: a drafter subclasses `Drafter` to take those defaults (prompt lookup
and the draft model need no `after_step`), and the proposer calls every method on every drafter,
never asking what it has. The engine core calls the proposer once per step with a `StepResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


@dataclass
class StepResult:
    """What one engine step leaves for the drafter, after postprocess."""

    step: Any  # the SchedulerOutput that ran
    token_ids: list  # per sampled entry: its token (a list of the kept tokens for a verify entry)
    kept: dict[int, int] = field(default_factory=dict)  # verify entry -> tokens kept (the rollback length)
    ended: list = field(default_factory=list)  # sequences that finished or were preempted in the step
    # the target's normed last hidden states (kvstate.engine.runner.StepHidden) when the drafter
    # asked for them (`Drafter.wants_hidden`), else None
    hidden: Any = None


class Drafter(Protocol):
    """A source of draft tokens: the n-gram lookup, a draft model, the checkpoint's MTP head."""

    # True: every step keeps the target's hidden states for `after_step` (StepResult.hidden), and
    # the engine's pools must hold the drafter's KV (the MTP head's)
    wants_hidden: ClassVar[bool] = False

    def propose(self, requests: list[tuple[Any, int]]) -> list[list[int]]:
        """requests: (sequence, most drafts wanted) -> drafts per request (maybe fewer, or none).
        Called after every step, with an empty list when no request wants drafts (a drafter may
        have work left over from `after_step`). Drafts are greedy (one-hot), which the rejection
        sampler assumes."""
        ...

    def release(self, seq) -> None:
        """seq finished or was preempted: drop whatever is held for it."""

    def after_step(self, result: StepResult) -> None:
        """After each non-empty step's postprocess, before `propose`: follow the target's step
        (the MTP head writes its KV from `result.hidden`). Optional: nothing by default."""
