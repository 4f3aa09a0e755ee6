"""Which requests get drafts each step, and how many (no torch).

After every step the engine asks the drafter for the drafts of each running request that is
ready to decode; the scheduler turns those decodes into verify entries. A request gets at most
`num_speculative_tokens`, and never more than its remaining length allows: the drafts and the
token after them must fit max_tokens and the model length, so the KV blocks the scheduler
reserved at admission always suffice. Requests with penalties or logprobs get none (their
sampling depends on each previous token in ways the rejection sampler does not replay).
"""

from __future__ import annotations

from kvstate.engine.sequence import Sequence, SequenceStatus
from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.engine.speculative.drafter import Drafter, StepResult


def eligible(params) -> bool:
    return not params.penalties and params.logprobs is None


class Proposer:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int):
        self.config, self.drafter, self.max_model_len = config, drafter, max_model_len
        self.num_verify_entries = 0  # totals over the engine's life
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def limit(self, seq: Sequence) -> int:
        """Most drafts seq may get now: the drafts plus the token after them stay within its limits."""
        if seq.status is not SequenceStatus.RUNNING or seq.num_remaining_tokens != 1 or not eligible(seq.params):
            return 0
        k = min(self.config.num_speculative_tokens, self.max_model_len - 1 - seq.num_tokens)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        return max(k, 0)

    def propose(self, running: list[Sequence]) -> None:
        """Set `spec_token_ids` of every running sequence (empty where it gets no drafts)."""
        wanted = []
        for seq in running:
            seq.spec_token_ids = []
            k = self.limit(seq)
            if k:
                wanted.append((seq, k))
        for (seq, k), drafts in zip(wanted, self.drafter.propose(wanted)):
            seq.spec_token_ids = list(drafts[:k])

    def after_step(self, result: StepResult, running: list[Sequence]) -> None:
        """After each step's postprocess: count its verify entries, let the drafter drop what it
        held for the ended requests and follow the step, then draft for the next step."""
        self.record(result.step, result.token_ids)
        for seq in result.ended:
            self.drafter.release(seq)
        if not result.step.is_empty:
            self.drafter.after_step(result)
        self.propose(running)

    def record(self, step, token_ids: list) -> None:
        """Count a step's verify entries: `token_ids[j]` is what sampled entry j got (a list for verify)."""
        for j, i in enumerate(step.sample_indices):
            drafts = step.drafts.get(i)
            if drafts:
                self.num_verify_entries += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(token_ids[j]) - 1

    def stats(self) -> dict:
        drafted = self.num_draft_tokens
        return {"spec_num_drafts": self.num_verify_entries, "spec_num_draft_tokens": drafted,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_acceptance_rate": self.num_accepted_tokens / drafted if drafted else 0.0,
                "spec_mean_accepted_length": (1 + self.num_accepted_tokens / self.num_verify_entries
                                              if self.num_verify_entries else 0.0)}


def make_drafter(config: SpeculativeConfig, core) -> Drafter:
    """The drafter `config` names, for an EngineCore: prompt lookup, the MTP head or a draft model."""
    if config.method == "ngram":
        from kvstate.engine.speculative.ngram import NgramDrafter

        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "mtp":
        from kvstate.engine.speculative.mtp import MtpDrafter

        return MtpDrafter(core.runner, core.scheduler.blocks)
    from kvstate.engine.speculative.draft_model import DraftModelDrafter

    return DraftModelDrafter.load(config.model, core, config.num_speculative_tokens)
