"""The scheduler without torch: admission, chunked prefill, budget, preemption and recompute,
stop conditions, rejection, and randomized runs against a fake model that stores real tokens
in fake KV blocks and state slots, so a leaked, shared or stale block or slot changes its output."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from kvstate.engine import SamplingParams, Scheduler, SchedulerConfig, SequenceStatus

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def make(num_blocks=16, block_size=4, num_slots=4, max_model_len=64, vocab=100, seqs=4, budget=16,
         eos=(), **kw) -> Scheduler:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                          max_model_len=max_model_len, vocab_size=vocab, max_num_seqs=seqs,
                          max_num_batched_tokens=budget, eos_token_ids=frozenset(eos))
    return Scheduler(cfg, **kw)


def step(s: Scheduler, token=7):
    sched = s.schedule()
    entries = [(seq.request_id, n, c) for (seq, n), c in zip(sched.entries, sched.context_lens)]
    return sched, entries, s.postprocess(sched, [token] * len(sched.sample_indices)).finished


def test_control_plane_imports_no_torch():
    code = ("import sys, kvstate.engine, kvstate.engine.scheduler, kvstate.engine.block_manager, "
            "kvstate.engine.params, kvstate.engine.sequence, kvstate.engine.scheduler_output, "
            "kvstate.engine.detokenizer, kvstate.engine.outputs, kvstate.engine.collector; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_chunked_prefill_feeds_the_prompt_in_pieces_and_samples_once():
    s = make(budget=8)
    seq = s.add("a", list(range(1, 26)), GREEDY)
    fed, contexts = [], []
    for _ in range(4):
        sched = s.schedule()
        assert len(sched) == 1 and sched.block_tables[0] == seq.block_table
        contexts.append(sched.context_lens[0])
        fed += sched.input_ids()
        assert sched.sample_indices == ([0] if len(fed) == 25 else [])
        s.postprocess(sched, [9] * len(sched.sample_indices))
    assert contexts == [0, 8, 16, 24] and fed == list(range(1, 26))
    assert seq.output_token_ids == [9] and seq.num_computed_tokens == 25
    sched, entries, _ = step(s)
    assert entries == [("a", 1, 25)] and sched.input_ids() == [9]  # decode feeds the sampled token


def test_scheduler_output_builds_the_models_batch():
    pytest.importorskip("torch")
    from kvstate.engine.runner import batch_layout
    from kvstate.models.batch import Batch

    s = make(block_size=4, budget=12)
    s.add("a", [1, 2, 3, 4, 5, 6], GREEDY)
    s.add("b", [7, 8, 9, 10, 11, 12, 13, 14, 15], GREEDY)
    sched = s.schedule()  # a: 6 tokens, b: first 6 of 9
    batch = Batch.from_layout(batch_layout(sched))
    assert batch.query_lens == [6, 6] and sched.sample_indices == [0]
    assert batch.cu_seqlens.tolist() == [0, 6, 12] and len(sched.input_ids()) == 12
    table_b = sched.block_tables[1]
    assert batch.kv_indices[6:].tolist() == [table_b[p // 4] * 4 + p % 4 for p in range(6)]
    assert batch.state_slots.tolist() == sched.state_slots and len(set(sched.state_slots)) == 2
    s.postprocess(sched, [5])
    sched = s.schedule()  # a decodes at position 6, b finishes its prompt
    batch = Batch.from_layout(batch_layout(sched))
    assert batch.positions.tolist() == [6, 6, 7, 8] and batch.context_lens == [6, 6]


def test_decodes_first_then_continuing_prefills_then_admissions():
    s = make(budget=6, seqs=8, num_slots=8, num_blocks=64)
    for r in "ab":
        s.add(r, [1, 2], GREEDY)
    step(s)  # a, b prefilled: both decode next
    s.add("c", list(range(1, 11)), GREEDY)
    _, entries, _ = step(s)
    assert entries == [("a", 1, 2), ("b", 1, 2), ("c", 4, 0)]  # c gets what the decodes leave
    s.add("d", [1, 2, 3], GREEDY)
    _, entries, _ = step(s)
    assert entries == [("a", 1, 3), ("b", 1, 3), ("c", 4, 4)]  # c continues before d is admitted
    _, entries, _ = step(s)
    assert entries == [("a", 1, 4), ("b", 1, 4), ("c", 2, 8), ("d", 2, 0)]


def test_admission_needs_a_slot_blocks_and_room_and_keeps_order():
    s = make(num_slots=2, seqs=4, budget=64)
    for r in "abc":
        s.add(r, [1, 2, 3], GREEDY)
    _, entries, _ = step(s)
    assert [e[0] for e in entries] == ["a", "b"]  # two state slots
    s = make(num_slots=4, seqs=1, budget=64)
    s.add("a", [1], GREEDY), s.add("b", [1], GREEDY)
    assert [e[0] for e in step(s)[1]] == ["a"]  # max_num_seqs
    s = make(num_blocks=5, block_size=4, budget=64)
    s.add("a", [1] * 12, SamplingParams(max_tokens=2))  # 3 blocks
    s.add("b", [1] * 12, SamplingParams(max_tokens=2))  # needs 3, 2 free
    s.add("c", [1] * 4, SamplingParams(max_tokens=2))  # would fit, must not overtake b
    assert [e[0] for e in step(s)[1]] == ["a"]
    _, entries, finished = step(s)  # a finishes (max_tokens=2): its blocks come back
    assert [f.request_id for f in finished] == ["a"]
    assert [e[0] for e in step(s)[1]] == ["b", "c"]


def test_preemption_frees_the_newest_and_recomputes_it_from_scratch():
    s = make(num_blocks=4, block_size=2, budget=32, num_slots=2)
    a = s.add("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3))
    b = s.add("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=4))
    c = s.add("c", [7], SamplingParams(temperature=0, max_tokens=1))  # waits: two state slots
    sched, entries, _ = step(s, token=11)  # a and b prefilled: 2 blocks each, pool full
    assert entries == [("a", 3, 0), ("b", 3, 0)] and s.blocks.num_free_blocks == 0
    sched, entries, _ = step(s, token=12)  # both decode at position 3: room in their second block
    assert entries == [("a", 1, 3), ("b", 1, 3)]
    sched, entries, _ = step(s, token=13)  # position 4 needs a third block: b (newest) makes room
    assert entries == [("a", 1, 4)] and sched.preempted == [b]  # and c is not admitted this step
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.state_slot is None
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and list(s.waiting) == [b, c]
    assert a.is_finished and a.output_token_ids == [11, 12, 13]  # a done: its blocks come back
    sched, entries, _ = step(s, token=14)
    assert entries == [("b", 5, 0), ("c", 1, 0)] and sched.input_ids() == [4, 5, 6, 11, 12, 7]  # prompt + outputs
    assert sched.sample_indices == [0, 1] and c.is_finished
    step(s, token=15)
    assert b.is_finished and b.output_token_ids == [11, 12, 14, 15] and not s.has_work()
    assert s.blocks.num_free_blocks == 4 and s.slots.num_free_slots == 2


def test_a_continuing_prefill_that_finds_no_block_waits_with_its_cache():
    s = make(num_blocks=4, block_size=2, budget=3)
    s.add("a", [1, 2, 3], SamplingParams(max_tokens=4))
    x = s.add("x", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=1))
    assert step(s)[1] == [("a", 3, 0)]
    assert step(s)[1] == [("a", 1, 3), ("x", 2, 0)]
    sched, entries, _ = step(s)  # a takes the last block; x has no room and nothing newer to preempt
    assert entries == [("a", 1, 4)] and not sched.preempted
    assert x.status is SequenceStatus.RUNNING and x.num_computed_tokens == 2 and len(x.block_table) == 1
    assert step(s)[1] == [("a", 1, 5)]  # a finishes here
    assert step(s)[1] == [("x", 3, 2)]  # x carries on from its cache


def test_a_decode_that_is_the_newest_and_finds_no_block_preempts_itself():
    s = make(num_blocks=4, block_size=2, budget=3)
    s.add("a", [1, 2, 3], SamplingParams(max_tokens=3))
    b = s.add("b", [4, 5], SamplingParams(max_tokens=4))
    assert step(s)[1] == [("a", 3, 0)]  # the budget holds a's prompt only
    assert step(s)[1] == [("a", 1, 3), ("b", 2, 0)]
    sched, entries, finished = step(s)  # a takes the last block; b needs one, nothing newer: b goes
    assert entries == [("a", 1, 4)] and sched.preempted == [b] and b.status is SequenceStatus.WAITING
    assert [f.request_id for f in finished] == ["a"]  # b's recompute would fit, but not in this step
    sched, entries, _ = step(s)
    assert entries == [("b", 3, 0)] and sched.input_ids() == [4, 5, 7]


def test_stop_conditions():
    s = make(eos=[0], max_model_len=10, detokenize=lambda ids: "".join(chr(97 + t % 26) for t in ids))
    runs = {
        "eos": (SamplingParams(max_tokens=9), [3, 0], ("stop", None)),
        "ignore_eos": (SamplingParams(max_tokens=3, ignore_eos=True), [0, 0, 0], ("length", None)),
        "stop_id": (SamplingParams(stop_token_ids=[5], max_tokens=9), [3, 5], ("stop", 5)),
        "max_tokens": (SamplingParams(max_tokens=2), [3, 4], ("length", None)),
        "model_len": (SamplingParams(max_tokens=None), [3, 3, 3, 3], ("length", None)),  # 6 + 4 = 10
        "stop_str": (SamplingParams(stop=["xy", "cd"], max_tokens=9), [1, 2, 3], ("stop", "cd")),
    }
    seqs = {r: s.add(r, [1] * 6, p) for r, (p, _, _) in runs.items()}
    done = {}
    for i in range(12):
        sched = s.schedule()
        toks = [runs[q.request_id][1][min(q.num_output_tokens, len(runs[q.request_id][1]) - 1)]
                for q in sched.sample_seqs()]
        done.update({f.request_id: f for f in s.postprocess(sched, toks).finished})
    for r, (_, toks, reason) in runs.items():
        assert (done[r].finish_reason, done[r].stop_reason) == reason, r
        assert done[r].output_token_ids == toks, r
    assert seqs["stop_str"].output_text == "b"  # "bcd" cut before the stop string
    assert s.blocks.num_free_blocks == 16 and s.slots.num_free_slots == 4


BAD = {
    "empty": ([], "prompt is empty"),
    "string": ("hello", "list of token ids, got str"),
    "float": ([1, 2.5], "prompt token 1 is 2.5, not an integer"),
    "bool": ([True], "prompt token 0 is True"),
    "none": ([1, None], "prompt token 1 is None"),
    "negative": ([3, -1], r"prompt token 1 is -1, outside the vocabulary \[0, 100\)"),
    "too_big": ([100], "prompt token 0 is 100, outside"),
    "too_long": ([1] * 65, "prompt has 65 tokens, more than the model's maximum length 64"),
}


def test_malformed_requests_are_rejected_and_the_others_served():
    s = make(num_blocks=12, block_size=4)
    good = [s.add(f"ok{i}", [1, 2, 3], GREEDY) for i in range(2)]
    bad = {r: s.add(r, prompt, GREEDY) for r, (prompt, _) in BAD.items()}
    bad["pool"] = s.add("pool", [1] * 40, SamplingParams(max_tokens=10))  # KV for 49 tokens > 12 blocks * 4
    bad["no_detok"] = s.add("no_detok", [1], SamplingParams(stop="x"))
    params = SamplingParams()
    params.top_p = 0  # invalid after construction: caught when the request arrives
    bad["params"] = s.add("params", [1], params)
    bad["dup"] = s.add("ok0", [1], GREEDY)
    good.append(s.add("ok2", [4, 5], GREEDY))
    want = {**{r: m for r, (_, m) in BAD.items()},
            "pool": "needs up to 13 KV blocks of 4 tokens; the cache pool holds 12",
            "no_detok": "stop strings need a detokenizer", "params": r"top_p must be in \(0, 1\]",
            "dup": "request id 'ok0' is already in use"}
    for r, seq in bad.items():
        assert seq.status is SequenceStatus.REJECTED and seq.finish_reason == "error", r
        assert re.search(want[r], seq.error), (r, seq.error)
    reported = []
    while s.has_work():
        reported += step(s)[2]
    assert all(g.finish_reason == "length" and len(g.output_token_ids) == 4 for g in good)
    assert sorted(map(id, reported)) == sorted(map(id, good + list(bad.values())))  # each reported once


def test_abort_metrics_and_misuse():
    clock = iter(range(100)).__next__
    s = make(clock=lambda: float(clock()))
    a = s.add("a", [1, 2], SamplingParams(max_tokens=3))  # arrives at t=0
    w = s.add("w", [1], GREEDY, arrival_time=0.5)
    assert s.abort("w") and w.finish_reason == "abort" and not s.abort("nobody")
    sched = s.schedule()
    with pytest.raises(RuntimeError, match="before postprocess"):
        s.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled tokens"):
        s.postprocess(sched, [])
    s.postprocess(sched, [3])  # clock: arrival 0, abort 1, schedule 2, first token at 3
    step(s), step(s)  # clock: schedule 4, tokens at 5, schedule 6, tokens at 7
    assert a.finish_reason == "length" and a.output_token_ids == [3, 7, 7]
    assert (a.time_to_first_token, a.time_per_output_token, a.latency) == (3.0, 2.0, 7.0)
    running = s.add("r", [1, 2, 3], GREEDY)
    sched = s.schedule()
    assert s.abort("r") and s.slots.num_free_slots == 4 and s.blocks.num_free_blocks == 16
    assert s.postprocess(sched, [1]).finished and running.output_token_ids == []  # the aborted result is dropped


# randomized runs ---------------------------------------------------------------------------
MOD = 1_000_003


def next_token(tokens_hash: int, kv_sum: int, vocab: int) -> int:
    return (tokens_hash * 7 + kv_sum) % vocab


def reference_output(prompt: list[int], params: SamplingParams, cfg: SchedulerConfig) -> list[int]:
    """What one request gives alone under the fake model (its whole context in one pass each step)."""
    tokens, out = list(prompt), []
    while True:
        h = 0
        for t in tokens:
            h = (h * 31 + t) % MOD
        tok = next_token(h, sum(t * (p + 1) for p, t in enumerate(tokens)), cfg.vocab_size)
        out.append(tok)
        tokens.append(tok)
        if (tok in cfg.eos_token_ids or len(out) == params.max_tokens or len(tokens) >= cfg.max_model_len):
            return out


class FakeModel:
    """Writes the real tokens into fake KV blocks and folds them into a per-slot hash (the state);
    its next token reads both back, so a block or slot used by two sequences changes the output."""

    def __init__(self, cfg: SchedulerConfig):
        self.bs, self.vocab = cfg.block_size, cfg.vocab_size
        self.kv = [[None] * cfg.block_size for _ in range(cfg.num_blocks)]
        self.state = [None] * cfg.num_slots

    def run(self, sched) -> list[int]:
        ids, off, out = sched.input_ids(), 0, []
        captures = {(i, k): slot for i, k, slot in sched.captures}  # prefix caching: states inside a chunk
        for i, n in enumerate(sched.num_tokens):
            c, table, slot = sched.context_lens[i], sched.block_tables[i], sched.state_slots[i]
            h = 0 if c == 0 else self.state[slot]  # a fresh sequence starts from zeros
            for p in range(c, c + n):
                self.kv[table[p // self.bs]][p % self.bs] = ids[off]
                h = (h * 31 + ids[off]) % MOD
                off += 1
                if (i, p + 1 - c) in captures:
                    self.state[captures[i, p + 1 - c]] = h
            self.state[slot] = h
            if sched.samples[i]:
                kv_sum = sum(self.kv[table[p // self.bs]][p % self.bs] * (p + 1) for p in range(c + n))
                out.append(next_token(h, kv_sum, self.vocab))
        return out


def check_step(s: Scheduler, sched) -> None:
    cfg = s.config
    assert sched.total_tokens <= cfg.max_num_batched_tokens and len(sched) <= cfg.max_num_seqs
    assert len({id(q) for q in sched.seqs}) == len(sched) and all(n >= 1 for n in sched.num_tokens)
    for seq, n, c, table in zip(sched.seqs, sched.num_tokens, sched.context_lens, sched.block_tables):
        assert seq.status is SequenceStatus.RUNNING and c == seq.num_computed_tokens
        assert c + n <= seq.num_tokens and len(table) * cfg.block_size >= c + n


def check_pools(s: Scheduler) -> None:
    """No block or slot leaked or owned twice; waiting sequences own nothing."""
    owned = [b for q in s.running for b in q.block_table]
    assert len(owned) == len(set(owned)) and len(owned) + s.blocks.num_free_blocks == s.config.num_blocks
    assert all(s.blocks.ref_count(b) == 1 for b in owned)
    slots = [q.state_slot for q in s.running]
    assert None not in slots and len(slots) == len(set(slots)) and all(s.slots.in_use(x) for x in slots)
    assert len(slots) + s.slots.num_free_slots == s.config.num_slots
    for q in s.running:
        assert q.status is SequenceStatus.RUNNING and len(q.block_table) == s.blocks.blocks_for(q.num_computed_tokens)
    for q in s.waiting:
        assert q.status is SequenceStatus.WAITING and not q.block_table and q.state_slot is None
        assert q.num_computed_tokens == 0


def simulate(cfg: SchedulerConfig, seed: int, num_requests: int, max_prompt: int, groups: int = 0) -> dict:
    """`groups`: requests come in fan-outs of 1-6 sequences from that many client groups (fair-share
    admission and preemption); `num_requests` may then be overshot by a fan-out."""
    import random

    rng = random.Random(seed)
    s, model = Scheduler(cfg), FakeModel(cfg)
    added, done, stats = [], {}, {"preemptions": 0, "chunks": 0, "steps": 0}
    while len(added) < num_requests or s.has_work():
        while len(added) < num_requests and rng.random() < 0.3:
            prompt = [rng.randrange(1, cfg.vocab_size) for _ in range(rng.randint(1, max_prompt))]
            if rng.random() < 0.03:
                prompt[-1] = cfg.vocab_size  # malformed: rejected, the others carry on
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 12))
            group = rng.randrange(groups) if groups else None
            for _ in range(rng.randint(1, 6) if groups else 1):  # a group's request fans out
                added.append(s.add(len(added), prompt, params, group=group))
        if s.running and rng.random() < 0.01:
            s.abort(rng.choice(s.running).request_id)
        sched = s.schedule()
        check_step(s, sched)
        stats["preemptions"] += len(sched.preempted)
        stats["chunks"] += sum(1 for x in sched.samples if not x)
        for f in s.postprocess(sched, model.run(sched)).finished:
            assert f.request_id not in done
            done[f.request_id] = f
        check_pools(s)
        stats["steps"] += 1
        assert stats["steps"] < 50 * num_requests * cfg.max_model_len, "the scheduler stopped making progress"
    assert sorted(done) == list(range(len(added)))  # every request finished, once
    for seq in added:
        if seq.finish_reason == "error":
            assert "outside the vocabulary" in seq.error
            continue
        want = reference_output(seq.prompt_token_ids, seq.params, cfg)
        if seq.finish_reason == "abort":
            assert seq.output_token_ids == want[: seq.num_output_tokens]
        else:
            assert seq.output_token_ids == want, seq.request_id
    return stats


@pytest.mark.parametrize("seed", range(3))
def test_random_arrivals_with_a_tiny_pool(seed):
    cfg = SchedulerConfig(num_blocks=14, block_size=2, num_slots=4, max_model_len=24, vocab_size=23,
                          max_num_seqs=4, max_num_batched_tokens=7, eos_token_ids=frozenset({0}))
    stats = simulate(cfg, seed, num_requests=600, max_prompt=20)
    assert stats["preemptions"] > 20 and stats["chunks"] > 20 and stats["steps"] > 2000  # it was exercised


def test_random_configs():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
    @hypothesis.given(st.integers(1, 4), st.integers(0, 4), st.integers(1, 4), st.integers(1, 5), st.integers(1, 12),
                      st.integers(4, 20), st.integers(0, 10**6))
    def run(block_size, extra_blocks, num_slots, max_seqs, budget, max_len, seed):
        need = -(-max_len // block_size)  # one sequence of the maximum length
        cfg = SchedulerConfig(num_blocks=need + extra_blocks, block_size=block_size, num_slots=num_slots,
                              max_model_len=max_len, vocab_size=11, max_num_seqs=max_seqs,
                              max_num_batched_tokens=budget, eos_token_ids=frozenset({0}))
        simulate(cfg, seed, num_requests=12, max_prompt=max_len)

    run()


def test_the_step_carries_slot_copies_and_finished_request_ids():
    """The runner's work besides the forward comes in the step: no one reaches into the slot manager."""
    s = make()
    a = s.add("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    first, _, _ = step(s)
    assert first.slot_copies == [] and first.finished_request_ids == []
    src = a.state_slot
    spare = s.slots.copy_slot(src)  # e.g. a snapshot of a's state
    second, _, finished = step(s)
    assert second.slot_copies == [(src, spare)]
    assert [f.request_id for f in finished] == ["a"] and second.finished_request_ids == []
    third = s.schedule()
    assert third.finished_request_ids == ["a"] and third.slot_copies == []
    s.postprocess(third, [])
    assert s.schedule().finished_request_ids == []


def test_stop_token_ids_outside_the_vocabulary_are_rejected():
    s = make(vocab=50)
    bad = s.add("bad", [1, 2], SamplingParams(stop_token_ids=[3, 50, 77]))
    assert bad.status is SequenceStatus.REJECTED and "[50, 77]" in bad.error and "vocabulary [0, 50)" in bad.error
