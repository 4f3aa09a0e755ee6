"""Verify entries in the torch-free scheduler: drafts scheduled with the decode, accepted tokens
appended up to a stop, the KV blocks past the accepted length freed, the kept count recorded."""

from kvstate.engine import SamplingParams, Scheduler, SchedulerConfig
from kvstate.engine.speculative.ngram import NgramDrafter
from kvstate.engine.speculative.config import SpeculativeConfig
from kvstate.engine.speculative.proposer import Proposer


def make(**kw):
    cfg = SchedulerConfig(num_blocks=16, block_size=4, num_slots=4, max_model_len=64, vocab_size=100,
                          max_num_seqs=4, max_num_batched_tokens=32, **kw)
    return Scheduler(cfg)


def prefill(s, prompt, params):
    seq = s.add("a", prompt, params)
    s.postprocess(s.schedule(), [50])
    return seq


def test_a_verify_entry_keeps_the_accepted_tokens_and_frees_the_rejected_blocks():
    s = make()
    seq = prefill(s, [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    seq.spec_token_ids = [60, 61, 62, 63, 64]
    step = s.schedule()
    assert step.num_tokens == [6] and step.drafts == {0: [60, 61, 62, 63, 64]} and step.samples == [True]
    assert step.input_ids() == [50, 60, 61, 62, 63, 64]
    assert step.modes() == ["verify"]
    assert len(seq.block_table) == 3 and s.blocks.num_used_blocks == 3  # 9 tokens of KV written
    _, kept = s.postprocess(step, [[60, 70]])  # 60 accepted, 61 rejected: 70 sampled in its place
    assert seq.output_token_ids == [50, 60, 70]
    assert seq.num_computed_tokens == 5 and kept == {0: 2}
    assert len(seq.block_table) == 2 and s.blocks.num_used_blocks == 2  # the third block held only drafts
    assert (seq.num_draft_tokens, seq.num_accepted_tokens) == (5, 1)
    nxt = s.schedule()  # no drafts now: a plain decode of 70
    assert nxt.num_tokens == [1] and not nxt.drafts and nxt.context_lens == [5]


def test_a_stop_inside_the_accepted_tokens_ends_the_request_there():
    s = make()
    seq = prefill(s, [1, 2, 3], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[61]))
    seq.spec_token_ids = [60, 61, 62]
    step = s.schedule()
    finished, kept = s.postprocess(step, [[60, 61, 62, 9]])
    assert finished == [seq] and seq.output_token_ids == [50, 60, 61] and seq.finish_reason == "stop"
    assert kept == {0: 2} and s.blocks.num_used_blocks == 0


def test_the_proposer_keeps_drafts_within_max_tokens_and_the_model_length():
    s = make()
    seq = prefill(s, [5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    prop = Proposer(SpeculativeConfig("ngram", 8), NgramDrafter(1, 3), max_model_len=64)
    seq.output_token_ids[-1] = 7  # the context repeats: lookup drafts 5, 6, 7, ...
    prop.propose(s.running)
    assert seq.spec_token_ids == [5, 6]  # 4 tokens at most: 1 so far, 2 drafts + the one after them
    penalized = make()
    other = prefill(penalized, [5, 6, 7, 5, 6, 7], SamplingParams(max_tokens=9, presence_penalty=0.5))
    prop.propose(penalized.running)
    assert other.spec_token_ids == []
