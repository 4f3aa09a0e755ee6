"""Where prefix caching keeps state, so that the SECOND request already resumes (issue 28): a repeat
of a prompt computes only its last token, a conversation sharing a system or document message
computes only its own messages, a caller's cache_prefix is honoured; outputs stay the plain
engine's on four families (also with speculative decoding), and snapshots stay within the pools."""

from __future__ import annotations

import random

import pytest

from kvstate import LLM, SamplingParams, model_path
from tests.engine.test_engine import FAMILIES, VOCAB
from tests.engine.test_prefix_scheduler import check_prefix_pools
from tests.models.checks import random_ids

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
NAMES = ["Alice Smith", "Bob Jones", "Carol White", "Dan Brown", "Eve Black", "Frank Green", "Grace Hall",
         "Hank Moss", "Ivy Stone", "Jack Reed", "Kate Lane", "Liam Ford", "Mia Cole", "Noah Webb", "Olga Park"]


def test_the_issue_table_on_the_shipped_hybrid():
    """A ~195-token phone book chat: the identical request hits on its second send, and a different
    question about the same book (its own message) computes only the question's message."""
    llm = LLM(model_path("kvstate-phonebook-hybrid"), cache_memory="64MiB", enable_prefix_caching=True)
    plain = LLM(model_path("kvstate-phonebook-hybrid"), cache_memory="64MiB")
    rng = random.Random(0)
    book = "Phone book:\n" + "\n".join(f"{n}: {rng.randrange(10**6, 10**7)}" for n in NAMES)

    def chat(question):
        return [{"role": "system", "content": book}, {"role": "user", "content": question}]

    asks = ["What is Alice Smith's number?"] * 3 + ["What is Bob Jones's number?", "Who has number 1234567?"]
    rows = []
    for q in asks:
        got, want = llm.chat(chat(q), GREEDY)[0], plain.chat(chat(q), GREEDY)[0]
        assert got.token_ids == want.token_ids
        rows.append((len(got.prompt_token_ids), got.num_cached_tokens))
    length = rows[0][0]
    assert length > 150
    assert [c for _, c in rows[:3]] == [0, length - 1, length - 1]  # a repeat recomputes one token
    system_end = llm.tokenizer.message_ends(chat(asks[3]), plain.chat(chat(asks[3]), GREEDY)[0].prompt_token_ids)[0]
    assert rows[3][1] == system_end  # the system message's end (and the next header): only the question computed
    assert rows[4][1] >= system_end
    assert len(llm.tokenizer.encode(asks[3], add_special_tokens=False)) + 8 > rows[3][0] - rows[3][1]
    stats = llm.stats()
    assert stats["prefix_hits_repeat"] == 2 and stats["prefix_hits_chat"] >= 1


@pytest.fixture(scope="module", params=list(FAMILIES))
def path(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    FAMILIES[request.param]().save_pretrained(out)
    return out


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_repeats_shared_documents_and_cache_prefix_are_exact(path, spec):
    plain = LLM(path, cache_memory="16MiB", block_size=4)
    cached = LLM(path, cache_memory="16MiB", block_size=4, enable_prefix_caching=True, snapshot_interval=16,
                 speculative_config=spec)
    doc = random_ids(VOCAB, 37, 1)
    prompts = [doc + random_ids(VOCAB, 3, 2)] * 2  # a repeat: one token computed
    prompts += [doc + random_ids(VOCAB, 5, 3 + i) for i in range(2)]  # the interval (32), then the branch point
    named = {"prompt_token_ids": random_ids(VOCAB, 21, 9) + random_ids(VOCAB, 4, 10), "cache_prefix": 21}
    other = {"prompt_token_ids": named["prompt_token_ids"][:21] + random_ids(VOCAB, 6, 11)}
    outs = [cached.generate([p], GREEDY)[0] for p in prompts + [named, other]]
    assert [o.num_cached_tokens for o in outs] == [0, 39, 32, 37, 0, 21]
    want = plain.generate(prompts + [named["prompt_token_ids"], other["prompt_token_ids"]], GREEDY)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    stats = cached.stats()
    assert (stats["prefix_hits_repeat"], stats["prefix_hits_interval"], stats["prefix_hits_branch"],
            stats["prefix_hits_prefix"]) == (1, 1, 1, 1)


def test_snapshots_stay_within_the_pools_under_shared_documents(path):
    """Random requests over a few shared documents (repeats, new questions, next turns, aborts): every
    step, what snapshots hold plus the running requests' state slots fit the cache budget, the pools'
    counts are consistent, and outputs are the plain engine's."""
    rng = random.Random(5)
    llm = LLM(path, cache_memory="16MiB", block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
              enable_prefix_caching=True, snapshot_interval=8, num_snapshot_slots=2)
    core, sizes = llm.engine, llm.runner.sizes
    budget = 16 << 20
    docs = [random_ids(VOCAB, n, 50 + n) for n in (13, 22, 30)]
    seqs, steps = [], 0
    while len(seqs) < 16 or core.has_unfinished():
        if len(seqs) < 16 and rng.random() < 0.5:
            r = rng.random()
            if seqs and r < 0.25:
                base = list(rng.choice(seqs).prompt_token_ids)  # a repeat
            else:
                base = rng.choice(docs) + random_ids(VOCAB, rng.randint(1, 5), 100 + len(seqs))
            core.add_request(len(seqs), base, SamplingParams(temperature=0, max_tokens=rng.randint(1, 5),
                                                             ignore_eos=True),
                             snapshot_hints={len(base) // 2: "prefix"} if r > 0.8 else None)
            seqs.append(core.scheduler.waiting[-1])
        if core.scheduler.running and rng.random() < 0.03:
            core.abort_request(rng.choice(core.scheduler.running).request_id)
        core.step()
        check_prefix_pools(core.scheduler)
        stats = core.stats()
        running_slots = sum(q.state_slot is not None for q in core.scheduler.running)
        assert stats["snapshot_bytes"] + running_slots * sizes.slot_bytes <= budget
        steps += 1
    assert core.stats()["prefix_hits"] > 0
    from tests.greedy import greedy_generate

    for s in seqs:
        want = greedy_generate(llm.model, s.prompt_token_ids, s.params.max_tokens)
        assert s.output_token_ids == want[: len(s.output_token_ids)], s.request_id
