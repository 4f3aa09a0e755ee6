"""What the scheduler decides for one step, as host lists (no torch): the runner's whole input.

    step = scheduler.schedule()
    out = runner.execute(step)           # drop finished requests' sampling state, copy state
                                         # slots, build the model's Batch, model, sample
    finished, kept = scheduler.postprocess(step, out.token_ids)

Every entry computes at least one token, so with one logits row per entry, row i belongs to
entry i. Only entries whose cache catches up with their known tokens this step (`samples[i]`)
get a new token; a prompt chunk in the middle of a chunked prefill does not, and its row must
not be sampled (a seeded generator would drift with the chunking).

Besides the entries the step carries the work the runner does on the pools and its own state
before the forward: state-slot copies (`slot_copies`, src -> dst, in order), KV block copies
(`block_copies`: copy-on-write of a prefix cache's partial block) and the requests
finished since the last step (`finished_request_ids`), whose sampling state it drops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstate.engine.params import SamplingParams
from kvstate.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    block_size: int
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    context_lens: list[int] = field(default_factory=list)  # tokens already cached before this step
    block_tables: list[list[int]] = field(default_factory=list)  # copies taken when scheduled
    state_slots: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # entry gets a new token after this step
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting by this step
    slot_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # KV blocks (src, dst) before the forward
    finished_request_ids: list[object] = field(default_factory=list)  # since the previous step
    # speculative decoding: entry -> its drafts (a "verify" entry computes the last known token and
    # them, every row sampled)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # prefix caching: (entry, k, slot): after the entry's first k tokens (0 < k < its count) the linear
    # layers write their state and conv window into `slot` (a snapshot inside a prefill chunk)
    captures: list[tuple[int, int, int]] = field(default_factory=list)
    resumed: list[int] = field(default_factory=list)  # entries admitted this step from a snapshot (context > 0)

    def add(self, seq: Sequence, n: int, sample: bool | None = None) -> None:
        """`sample=False`: computed but not sampled from (a finished reply's last token, for its snapshot)."""
        assert n >= 1 and seq.state_slot is not None, (n, seq.state_slot)
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.context_lens.append(seq.num_computed_tokens)
        self.block_tables.append(list(seq.block_table))
        self.state_slots.append(seq.state_slot)
        if sample is None:  # max_tokens 0 (prompt logprobs only): the prompt's end is not sampled from
            sample = seq.num_computed_tokens + n == seq.num_tokens and seq.params.max_tokens != 0
        self.samples.append(sample)

    def add_drafts(self, drafts: list[int]) -> None:
        """Make the last entry a verify entry: the last known token, then `drafts` (kvstate.engine.speculative)."""
        i = len(self.seqs) - 1
        assert self.num_tokens[i] == 1 + len(drafts) and drafts, (self.num_tokens[i], drafts)
        self.drafts[i] = list(drafts)
        self.samples[i] = True

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def entries(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens it computes this step), in batch order."""
        return list(zip(self.seqs, self.num_tokens))

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def sample_indices(self) -> list[int]:
        """Entries (= logits rows, one per entry) whose next token must be sampled."""
        return [i for i, s in enumerate(self.samples) if s]

    def sample_params(self) -> list[SamplingParams]:
        return [self.seqs[i].params for i in self.sample_indices]

    def sample_seqs(self) -> list[Sequence]:
        return [self.seqs[i] for i in self.sample_indices]

    def prompt_rows(self) -> list[tuple[int, range]]:
        """(entry, prompt positions it scores) for the entries that score prompt tokens (prompt_logprobs)."""
        out = [(i, s.prompt_rows(c, n)) for i, (s, c, n) in enumerate(zip(self.seqs, self.context_lens,
                                                                          self.num_tokens))]
        return [(i, r) for i, r in out if len(r)]

    def modes(self) -> list[str] | None:
        """Each entry's mode when the step verifies drafts; None: the default (decode for one token)."""
        if not self.drafts:
            return None
        return ["verify" if i in self.drafts else "decode" if n == 1 else "prefill"
                for i, n in enumerate(self.num_tokens)]

    def input_ids(self) -> list[int]:
        """The packed token ids the step feeds, sequence after sequence."""
        out: list[int] = []
        for i, (seq, c, n) in enumerate(zip(self.seqs, self.context_lens, self.num_tokens)):
            drafts = self.drafts.get(i)
            out.extend(seq.token_ids(c, c + n) if drafts is None else seq.token_ids(c, c + 1) + drafts)
        return out
