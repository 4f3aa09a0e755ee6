"""Fair admission (no torch): one client request with many prompts or samples cannot starve a request
sent after it; the scheduler admits request groups in turn, each group's sequences in order."""

from __future__ import annotations

from collections import Counter

from kvstate.engine import SamplingParams, SchedulerConfig
from kvstate.engine.fair_queue import FairQueue, fair_victim
from kvstate.engine.sequence import Sequence
from tests.engine.test_scheduler import FakeModel, make, reference_output, simulate, step

LONG = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


def seq(rid, group=None):
    return Sequence(rid, [1], SHORT, group=group)


def test_groups_take_turns_and_keep_their_own_order():
    q = FairQueue()
    for i in range(4):
        q.append(seq(f"big{i}", group="big"))
    q.append(seq("chat", group="chat"))
    q.append(seq("solo"))  # no group: its own
    assert [s.request_id for s in q] == ["big0", "chat", "solo", "big1", "big2", "big3"]
    assert [q.popleft().request_id for _ in range(len(q))] == ["big0", "chat", "solo", "big1", "big2", "big3"]
    assert not q and len(q) == 0


def test_without_groups_it_is_first_come_first_served_and_preempted_go_first():
    q = FairQueue()
    a, b, c = seq("a"), seq("b"), seq("c")
    for s in (a, b, c):
        q.append(s)
    q.remove(b)
    q.appendleft(b)  # preempted: first in line
    assert q[0] is b and q[-1] is c and list(q) == [b, a, c]


def test_a_request_with_many_prompts_does_not_starve_a_later_one():
    s = make(num_blocks=64, num_slots=4, seqs=4, budget=64)
    for i in range(40):  # one request: 40 prompts x 50 tokens each
        s.add(f"big-{i}", [3, 4, 5], LONG, group="big")
    s.add("chat", [6, 7], SHORT, group="chat")
    steps = 0
    while s.has_work():
        _, entries, done = step(s)
        steps += 1
        if any(d.request_id == "chat" for d in done):
            break
    # the chat starts as soon as one slot frees (the first big sequence's 50 tokens), not after 40 of them
    assert steps <= 55, steps
    assert sum(1 for q in s.running if q.group == "big") >= 3


def test_a_request_queued_later_is_admitted_before_the_rest_of_an_earlier_fanout():
    s = make(num_blocks=64, num_slots=2, seqs=2, budget=64)
    for i in range(6):
        s.add(f"big-{i}", [3], SHORT, group="big")
    s.add("chat", [6], SHORT, group="chat")
    order = []
    while s.has_work():
        sched, _, _ = step(s)
        order += [q.request_id for q, _ in sched.entries if q.request_id not in order]
    assert order.index("chat") < order.index("big-2")


def test_a_group_at_its_fair_share_is_passed_over_for_one_below_it():
    q = FairQueue()
    for i in range(3):
        q.append(seq(f"big{i}", group="big"))
    q.append(seq("chat", group="chat"))
    counts = Counter({("group", "big"): 2})  # big runs 2 of 4 places; 2 groups: a share of 2 each
    assert q.pick(counts, 2.0).request_id == "chat"
    assert q.popleft(q.pick(counts, 2.0)).request_id == "chat" and q[0].request_id == "big0"
    assert q.pick(Counter(), 2.0).request_id == "big0"  # below its share: the ring's turn again
    assert q.pick(Counter({("group", "big"): 3}), 2.0).request_id == "big0"  # no one else waits: no idle place


def test_the_victim_comes_from_the_group_furthest_above_its_share_and_only_for_one_below():
    big = [Sequence(f"big{i}", [1], LONG, group="big") for i in range(3)]
    for i, s in enumerate(big):
        s.num_computed_tokens = [30, 5, 9][i]
    counts = Counter({("group", "big"): 3, ("group", "mid"): 1})
    chat = seq("chat", group="chat")
    assert fair_victim(big, counts, 4 / 3, chat) is big[1]  # the cheapest to recompute
    assert fair_victim(big, counts, 4 / 3, seq("mid2", group="mid")) is None  # mid runs its share already
    assert fair_victim(big, Counter({("group", "big"): 2}), 2.0, chat) is None  # big is not above its share


def test_a_request_sent_while_one_request_holds_every_place_gets_one_within_steps():
    """One request's 8 long sequences fill the 4 places; two chats sent after them start within a
    few steps (a big sequence is preempted and recomputed), not after a big sequence's 50 tokens,
    and every output still equals its solo run (a fake model that reads its blocks and slots)."""
    s = make(num_blocks=64, num_slots=4, seqs=4, budget=64, max_model_len=80, vocab=97)
    model = FakeModel(s.config)
    seqs = [s.add(f"big-{i}", [3, 4, 5 + i], LONG, group="big") for i in range(8)]

    def run():
        sched = s.schedule()
        s.postprocess(sched, model.run(sched))
        return sched

    run()
    assert [q.group for q in s.running] == ["big"] * 4
    seqs += [s.add("chat1", [6, 7], SHORT, group="c1"), s.add("chat2", [8], SHORT, group="c2")]
    started = {}
    for n in range(12):
        sched = run()
        started.update((q.request_id, n) for q, _ in sched.entries if q.request_id.startswith("chat"))
    assert set(started) == {"chat1", "chat2"} and max(started.values()) <= 4, started
    assert sum(q.num_preemptions for q in seqs) == 2  # big: 4 places -> 2
    while s.has_work():
        run()
    assert all(q.output_token_ids == reference_output(q.prompt_token_ids, q.params, s.config) for q in seqs)


def test_fair_share_preemption_keeps_every_output_equal_to_a_solo_run():
    cfg = SchedulerConfig(num_blocks=40, block_size=2, num_slots=6, max_model_len=24, vocab_size=23,
                          max_num_seqs=6, max_num_batched_tokens=9, eos_token_ids=frozenset({0}))
    stats = [simulate(cfg, seed, num_requests=300, max_prompt=16, groups=2) for seed in range(4)]
    assert sum(st["preemptions"] for st in stats) > 10  # for blocks and for the fair share
