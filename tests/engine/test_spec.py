"""Speculative decoding end to end: exact greedy outputs on four families, draft models, stats.

Outputs with speculation must be token for token the plain engine's (greedy), with chunked
prefill, arrivals over time and preemption under memory pressure. Besides prompt lookup (which
a random model rarely confirms), a test drafter replays the plain continuation with every third
token corrupted, so verify entries accept 0..k drafts and roll back to every length.
"""

import pytest

from kvstate import LLM, SamplingParams
from kvstate.engine.speculative.drafter import Drafter
from tests.greedy import greedy_generate
from tests.arrivals import run_arrivals
from tests.engine.test_engine import FAMILIES, LENGTHS, VOCAB, tiny_mamba2, tiny_qwen3_5
from tests.models.checks import random_ids, redraw_weights

NEW = 12


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param]().save_pretrained(path)
    return path


class NoisyReplay(Drafter):
    """Drafts the plain greedy continuation, every third position (by position) wrong."""

    def __init__(self, expected: dict[tuple, list[int]]):
        self.expected = expected  # prompt -> prompt + its plain greedy output

    def propose(self, requests):
        out = []
        for seq, k in requests:
            full, n = self.expected[tuple(seq.prompt_token_ids)], seq.num_tokens
            out.append([t if (n + i) % 3 else (t + 1) % VOCAB for i, t in enumerate(full[n : n + k])])
        return out


def small_spec_llm(path, spec, blocks=24, block_size=4, num_seqs=6, budget=24, **kw):
    probe = LLM(path, cache_memory="64MiB", block_size=block_size, max_num_seqs=num_seqs)
    s = probe.runner.cache_spec
    return LLM(path, cache_memory=num_seqs * s.state_bytes + blocks * block_size * s.kv_bytes_per_token,
               block_size=block_size, max_num_seqs=num_seqs, max_num_batched_tokens=budget, speculative_config=spec,
               **kw)


@pytest.mark.parametrize("drafter", ["noisy", "ngram"])
def test_speculation_gives_exact_greedy_tokens_under_preemption(checkpoint, drafter):
    llm = small_spec_llm(checkpoint, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    prompts = [random_ids(VOCAB, n, i) for i, n in enumerate(LENGTHS)]
    prompts[3] = [5, 6, 7, 8] * 4  # something prompt lookup can draft from
    expected = [greedy_generate(llm.model, p, NEW) for p in prompts]
    if drafter == "noisy":
        replay = NoisyReplay({tuple(p): p + e for p, e in zip(prompts, expected)})
        llm.engine.set_proposer(llm.engine.proposer.config, replay)
    done, _ = run_arrivals(llm.engine, prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    outs = [done[i] for i in range(len(prompts))]
    assert [o.token_ids for o in outs] == expected
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["state_slots_used"] == 0  # nothing leaked
    drafted = sum(o.metrics["num_draft_tokens"] for o in outs)
    accepted = sum(o.metrics["num_accepted_tokens"] for o in outs)
    assert stats["spec_num_draft_tokens"] == drafted > 0 and stats["spec_num_accepted_tokens"] == accepted
    if drafter == "noisy":
        assert 0 < accepted < drafted
        assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafted)
        if llm.runner.cache_spec.kv_bytes_per_token:
            assert sum(o.metrics["num_preemptions"] for o in outs) > 0


def test_stop_inside_the_accepted_drafts_ends_there(checkpoint):
    llm = LLM(checkpoint, cache_memory="16MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 6})
    prompt = random_ids(VOCAB, 9, 5)
    plain = greedy_generate(llm.model, prompt, NEW)
    llm.engine.set_proposer(llm.engine.proposer.config, NoisyReplay({tuple(prompt): prompt + plain}))
    stop = plain[7]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, stop_token_ids=[stop]))[0]
    assert out.token_ids == plain[: plain.index(stop) + 1] and out.finish_reason == "stop"
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_hybrid_draft_model_of_the_same_vocabulary(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    tiny_qwen3_5().save_pretrained(target)
    hf = tiny_qwen3_5()
    redraw_weights(hf, 1)  # another random model: it agrees with the target only sometimes
    hf.save_pretrained(draft)
    plain = LLM(target, cache_memory="16MiB")
    prompts = [random_ids(VOCAB, n, 20 + n) for n in (4, 19, 33)] + [[9, 8, 7] * 5]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for source in (draft, target):  # the target as its own draft accepts everything
        llm = LLM(target, cache_memory="16MiB", speculative_config={"model": str(source), "num_speculative_tokens": 3})
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
        stats = llm.stats()
        assert stats["spec_num_draft_tokens"] > 0
        if source == target:
            assert stats["spec_acceptance_rate"] == 1.0
        drafter = llm.engine.proposer.drafter
        assert not drafter.held and drafter.slots.num_free_slots == drafter.runner.sizes.num_slots
        # both models' pools come out of the one --cache-memory budget, the draft's sized for the target's tokens
        target_bytes, draft_bytes = sum(llm.engine.runner.pool_bytes.values()), sum(drafter.runner.pool_bytes.values())
        assert target_bytes + draft_bytes <= 16 << 20
        assert target_bytes + draft_bytes > 0.95 * (16 << 20)  # and little of it is left unused
        sizes = llm.engine.runner.sizes
        assert drafter.runner.sizes.num_blocks >= sizes.num_blocks  # same block size


def test_a_draft_without_kv_layers_keeps_block_ids_for_one_request_length(tmp_path):
    """A Mamba-2 target drafted by itself (no KV anywhere): the draft's bookkeeping blocks cover one
    request's length per slot, not the capacity of all requests per slot (32 x 1M tokens asked
    for ~20 GB of block ids at the default max_model_len)."""
    tiny_mamba2().save_pretrained(tmp_path)
    llm = LLM(tmp_path, cache_memory="16MiB", max_model_len=64, max_num_seqs=4, block_size=4,
              speculative_config={"model": str(tmp_path), "num_speculative_tokens": 3})
    drafter = llm.engine.proposer.drafter
    assert drafter.runner.sizes.num_blocks == 2 * 4 * -(-(64 + 3 + 4) // 4)
    prompt = random_ids(VOCAB, 9, 3)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    want = LLM(tmp_path, cache_memory="16MiB", max_model_len=64).generate([prompt], params)[0].token_ids
    assert llm.generate([prompt], params)[0].token_ids == want


def test_requests_with_penalties_or_logprobs_get_no_drafts(checkpoint):
    llm = LLM(checkpoint, cache_memory="16MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = [4, 5, 6] * 6
    outs = llm.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
                                          SamplingParams(temperature=0, max_tokens=6, logprobs=2)])
    plain = LLM(checkpoint, cache_memory="16MiB").generate(
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3),
                           SamplingParams(temperature=0, max_tokens=6, logprobs=2)])
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(o.metrics["num_draft_tokens"] == 0 for o in outs)
    assert outs[1].outputs[0].logprobs is not None


def test_sampled_speculation_runs_and_drafts(checkpoint):
    llm = LLM(checkpoint, cache_memory="16MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outs = llm.generate([[4, 5, 6] * 6] * 3, SamplingParams(temperature=0.8, top_k=10, seed=3, max_tokens=10,
                                                            ignore_eos=True))
    assert all(len(o.token_ids) == 10 for o in outs)
    assert llm.stats()["kv_blocks_used"] == 0


def test_prefix_caching_and_speculation_together_stay_exact(checkpoint):
    """A shared system prompt, two turns, a branch: cached prefixes and verify entries in the same steps."""
    llm = LLM(checkpoint, cache_memory="16MiB", block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
              enable_prefix_caching=True, snapshot_interval=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    system = random_ids(VOCAB, 13, 77)
    first = [system + random_ids(VOCAB, n, 80 + n) for n in (3, 6, 9)]
    want1 = [greedy_generate(llm.model, p, NEW) for p in first]
    second = [p + o + random_ids(VOCAB, 4, 90 + i) for i, (p, o) in enumerate(zip(first, want1))]
    second.append(first[0] + want1[0] + random_ids(VOCAB, 5, 99))  # another branch of the first chat
    want2 = [greedy_generate(llm.model, p, NEW) for p in second]
    replay = NoisyReplay({tuple(p): p + e for p, e in zip(first + second, want1 + want2)})
    llm.engine.set_proposer(llm.engine.proposer.config, replay)
    assert [o.token_ids for o in llm.generate(first, params)] == want1
    outs = llm.generate(second, params)
    assert [o.token_ids for o in outs] == want2
    assert all(o.num_cached_tokens > len(system) for o in outs)  # each turn reuses its conversation so far
    stats = llm.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]


def test_set_proposer_switches_between_requests_and_refuses_a_head_without_its_pools(checkpoint):
    """`EngineCore.set_proposer` turns speculation on and off between requests (the outputs stay the
    plain ones), refuses while requests are in flight, and refuses a drafter that needs the MTP
    head's pools in an engine built without them."""
    from kvstate.engine.speculative.mtp import MtpDrafter
    from kvstate.errors import KvstateError

    llm = LLM(checkpoint, cache_memory="16MiB")
    core, prompt = llm.engine, random_ids(VOCAB, 9, 5)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    plain = llm.generate([prompt], params)[0].token_ids
    prop = core.set_proposer({"method": "ngram", "num_speculative_tokens": 3},
                             NoisyReplay({tuple(prompt): prompt + plain}))
    assert core.proposer is prop and not core.runner.keep_hidden
    assert llm.generate([prompt], params)[0].token_ids == plain
    assert 0 < prop.num_accepted_tokens < prop.num_draft_tokens
    core.add_request("x", prompt, params)
    with pytest.raises(KvstateError, match="in flight"):
        core.set_proposer(None)
    while core.has_unfinished():
        core.step()
    assert core.set_proposer(None) is None and core.proposer is None
    assert llm.generate([prompt], params)[0].token_ids == plain
    with pytest.raises(KvstateError, match="pools hold its KV"):
        core.set_proposer({"method": "ngram", "num_speculative_tokens": 2}, MtpDrafter.__new__(MtpDrafter))
