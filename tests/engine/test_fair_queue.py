"""Fair admission (no torch): one client request with many prompts or samples cannot starve a request
sent after it; the scheduler admits request groups in turn, each group's sequences in order."""

from __future__ import annotations

from kvstate.engine import SamplingParams
from kvstate.engine.fair_queue import FairQueue
from kvstate.engine.sequence import Sequence
from tests.engine.test_scheduler import make, step

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
