"""The engine loop without a model: a stand-in core. A step that raises fails the requests it was
running (and the loop goes on serving), an add that raises fails only its request, an aborted
request is dropped from the routes and aborted in the core, and observers see every step."""

import asyncio
from types import SimpleNamespace

import pytest

from kvstate.engine.outputs import EngineOutput, RequestOutput
from kvstate.server.engine_loop import EngineLoop


class FakeCore:
    """Each request yields one token per step, finishing after `length`; `explode` steps raise."""

    def __init__(self, length=3):
        self.length, self.live, self.aborted, self.explode = length, {}, [], 0
        self.plan = SimpleNamespace(name="fake")

    def stats(self):
        return {"num_running": len(self.live), "num_waiting": 0}

    def add_request(self, rid, ids, params, group=None):
        if ids == "boom":
            raise RuntimeError("bad add")
        self.live[rid] = 0

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.live.pop(rid, None)

    def has_unfinished(self):
        return bool(self.live)

    def step(self):
        if self.explode:
            self.explode -= 1
            raise ValueError("kaboom")
        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            done = self.live[rid] == self.length
            final = RequestOutput(rid, None, [], []) if done else None
            outs.append(EngineOutput(rid, [7], "x", done, final))
            if done:
                del self.live[rid]
        return outs


def run(loop, jobs, take=None):
    async def main():
        sub = loop.submit(jobs)
        got = []
        async for choice, out in sub:
            got.append((choice, out))
            if take is not None and len(got) == take:
                sub.close()
                break
        return got

    return asyncio.run(asyncio.wait_for(main(), 10))


@pytest.fixture
def loop():
    core = FakeCore()
    seen = []
    loop = EngineLoop(SimpleNamespace(engine=core, plan=core.plan), model_name="fake")
    loop.step_observers.append(lambda c, outs, s: seen.append(len(outs)))
    loop.seen = seen
    loop.start()
    yield loop
    loop.stop()


def test_requests_run_and_observers_see_each_step(loop):
    got = run(loop, [([1], None), ([2], None)])
    assert sorted(c for c, o in got if o.finished) == [0, 1] and len(got) == 6
    assert loop.seen == [2, 2, 2]


def test_a_failing_step_fails_its_requests_and_serving_goes_on(loop):
    loop.core.explode = 1
    got = run(loop, [([1], None)])
    assert len(got) == 1 and got[0][1].output.error.startswith("engine step failed: ValueError: kaboom")
    assert loop.stats()["num_step_failures"] == 1
    assert [o.finished for _, o in run(loop, [([1], None)])] == [False, False, True]


def test_a_failing_add_fails_only_its_request(loop):
    got = run(loop, [("boom", None), ([1], None)])
    failed = [o for c, o in got if c == 0]
    assert len(failed) == 1 and failed[0].output.finish_reason == "error" and "bad add" in failed[0].output.error
    assert [o.finished for c, o in got if c == 1] == [False, False, True]
    assert loop.alive


def test_closing_a_submission_aborts_its_requests(loop):
    loop.core.length = 10**6
    got = run(loop, [([1], None)], take=2)
    assert len(got) == 2
    for _ in range(500):
        if loop.core.aborted:
            break
        asyncio.run(asyncio.sleep(0.01))
    assert loop.core.aborted == [loop.core.aborted[0]] and not loop.core.live
