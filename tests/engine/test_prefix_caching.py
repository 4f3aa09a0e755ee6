"""Prefix caching on real tiny checkpoints of four families: Qwen3.5 (Gated DeltaNet), Kimi Linear
(KDA + MLA), Nemotron-H-style Mamba-2 and Jamba (Mamba-1). Outputs with prefix caching equal the
plain engine's (multi-turn chats, a shared system prompt, branching conversations, preemption under
memory pressure, a random workload with aborts), and reuse is real: a later turn of a chat reports
the whole previous conversation as cached, not a block-rounded part of it."""

from __future__ import annotations

import random

import pytest

from kvstate import LLM, SamplingParams
from tests.greedy import greedy_generate
from tests.arrivals import run_arrivals
from tests.engine.test_engine import FAMILIES, VOCAB
from tests.engine.test_prefix_scheduler import check_prefix_pools
from tests.models.checks import random_ids

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def path(request, tmp_path_factory):
    hf = FAMILIES[request.param]()
    out = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(out)
    return out


def engines(path, **kw):
    plain = LLM(path, cache_memory="16MiB", block_size=4, **kw)
    cached = LLM(path, cache_memory="16MiB", block_size=4, enable_prefix_caching=True, snapshot_interval=8, **kw)
    return plain, cached


def test_six_turn_chats_reuse_the_whole_previous_conversation(path):
    plain, cached = engines(path)
    system = random_ids(VOCAB, 11, 1)
    chats = [list(system), list(system)]
    for turn in range(6):
        previous = [len(c) for c in chats]  # prompt + reply of the last turn
        for k, chat in enumerate(chats):
            chat += random_ids(VOCAB, 3 + k + turn, 100 * turn + k)
        want, got = plain.generate(chats, GREEDY), cached.generate(chats, GREEDY)
        for k, chat in enumerate(chats):
            assert got[k].token_ids == want[k].token_ids, (turn, k)
            if turn:
                assert got[k].num_cached_tokens == previous[k], (turn, k)
            chat += want[k].token_ids
    stats = cached.stats()
    assert stats["prefix_cached_tokens"] >= sum(len(c) for c in chats) and stats["snapshots_held"] > 0
    assert stats["snapshot_bytes"] >= stats["snapshots_held"] * cached.runner.sizes.slot_bytes
    assert plain.generate(chats, GREEDY)[0].num_cached_tokens is None  # not reported when off


def test_shared_system_prompt_and_branching_conversations(path):
    plain, cached = engines(path)
    system = random_ids(VOCAB, 22, 2)  # 5 full blocks and a partial one
    first = system + random_ids(VOCAB, 4, 3)
    reply = cached.generate([first], GREEDY)[0]
    assert reply.token_ids == plain.generate([first], GREEDY)[0].token_ids
    # a second user of the system prompt resumes at the last interval snapshot (16), branches off where
    # it leaves the first prompt's tokens (22: inside the sixth block, not rounded down to its start)
    # and leaves a snapshot there, which the third one starts from
    others = [system + random_ids(VOCAB, 3 + i, 10 + i) for i in range(3)]
    outs = [cached.generate([p], GREEDY)[0] for p in others]
    assert [o.num_cached_tokens for o in outs] == [16, 22, 22]
    # two continuations of one conversation, at once: both start from its end (partial block copied)
    conversation = first + reply.token_ids
    branches = [conversation + random_ids(VOCAB, 2 + i, 20 + i) for i in range(2)]
    outs += cached.generate(branches, GREEDY)
    assert [o.num_cached_tokens for o in outs[3:]] == [len(conversation)] * 2
    want = plain.generate(others + branches, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]


def test_preemption_under_memory_pressure_stays_exact(path):
    probe = LLM(path, cache_memory="64MiB", block_size=4)
    spec = probe.runner.cache_spec
    budget = 9 * spec.state_bytes + 16 * 4 * spec.kv_bytes_per_token  # 4 sequences + 5 snapshots, 16 blocks
    llm = LLM(path, cache_memory=budget, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
              enable_prefix_caching=True, snapshot_interval=8, num_snapshot_slots=5)
    core = llm.engine
    systems = [random_ids(VOCAB, 13, 5), random_ids(VOCAB, 9, 6)]
    prompts = [systems[i % 2] + random_ids(VOCAB, 2 + i % 5, 30 + i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    done, _ = run_arrivals(core, prompts, params, after_step=lambda c: check_prefix_pools(c.scheduler))
    if spec.kv_bytes_per_token:  # a model without KV layers never runs out of blocks
        assert sum(o.metrics["num_preemptions"] for o in done.values()) > 0
    assert core.stats()["prefix_hits"] > 0
    for i, p in enumerate(prompts):
        assert done[i].token_ids == greedy_generate(llm.model, p, 8), i


def test_random_workload_with_aborts_is_exact_and_leaks_nothing(path):
    rng = random.Random(3)
    llm = LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=3, max_num_batched_tokens=10,
              enable_prefix_caching=True, snapshot_interval=6, num_snapshot_slots=3)
    core = llm.engine
    system = random_ids(VOCAB, 10, 7)
    seqs, done, steps = [], {}, 0
    while len(seqs) < 14 or core.has_unfinished():
        if len(seqs) < 14 and rng.random() < 0.4:
            finished, r = [s for s in seqs if s.finish_reason == "length"], rng.random()
            if finished and r < 0.3:  # the next turn of a finished conversation
                prev = rng.choice(finished)
                base = prev.prompt_token_ids + prev.output_token_ids
            else:
                base = system if r < 0.8 else []
            prompt = base + random_ids(VOCAB, rng.randint(1, 6), 1000 + len(seqs))
            core.add_request(len(seqs), prompt, SamplingParams(temperature=0, max_tokens=rng.randint(1, 6),
                                                               ignore_eos=True))
            seqs.append(core.scheduler.waiting[-1])
        if core.scheduler.running and rng.random() < 0.05:
            core.abort_request(rng.choice(core.scheduler.running).request_id)
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.output
        check_prefix_pools(core.scheduler)
        steps += 1
    assert sorted(done) == list(range(14)) and core.stats()["prefix_hits"] > 0
    for s in seqs:
        want = greedy_generate(llm.model, s.prompt_token_ids, s.params.max_tokens)
        assert s.output_token_ids == want[: len(s.output_token_ids)], s.request_id
        if s.finish_reason == "length":
            assert len(s.output_token_ids) == len(want)
