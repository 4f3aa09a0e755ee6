"""The explorer's step recorder without torch: the real scheduler stepped by a stand-in for the
engine core (it samples token 7 for every row and keeps each step's SchedulerOutput as
`last_step`, as EngineCore.step does), so the recorder reads real steps. Chunked prefill, decode
and the recompute after a preemption are told apart; each request's positions add up; finished
rows keep their blocks; prefix snapshots show up when the scheduler's prefix cache holds them."""

import math
from types import SimpleNamespace

from kvstate.engine.block_manager import PoolSizes
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.server.explorer_engine import StepRecorder, prefix_snapshots, step_modes

BS = 4


class StandInCore:
    """What the recorder reads of an EngineCore: scheduler, pool sizes, stats(), max_model_len, last_step."""

    def __init__(self, num_blocks: int, num_slots: int, budget: int, max_num_seqs: int | None = None, **prefix):
        self.max_model_len, self.last_step = 64, None
        self.runner = SimpleNamespace(sizes=PoolSizes(num_blocks, num_slots, block_bytes=BS * 10, slot_bytes=1000))
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, num_slots=num_slots,
                                                   max_model_len=64, vocab_size=100,
                                                   max_num_seqs=max_num_seqs or num_slots,
                                                   max_num_batched_tokens=budget, **prefix))

    def add_request(self, rid, prompt, params):
        self.scheduler.add(rid, prompt, params)

    def has_unfinished(self):
        return self.scheduler.has_work()

    def step(self):
        step = self.last_step = self.scheduler.schedule()
        finished = self.scheduler.postprocess(step, [7] * len(step.sample_indices)).finished
        outs = [SimpleNamespace(request_id=q.request_id, finished=False, output=None) for q in step.sample_seqs()
                if not q.is_finished]
        for q in finished:
            done = SimpleNamespace(outputs=[SimpleNamespace(finish_reason=q.finish_reason)])
            outs.append(SimpleNamespace(request_id=q.request_id, finished=True, output=done))
        return outs

    def stats(self):
        s, sizes = self.scheduler, self.runner.sizes
        slots = sizes.num_slots - s.slots.num_free_slots
        return {"kv_blocks_used": s.blocks.num_used_blocks, "state_slots_used": slots,
                "kv_bytes_in_use": s.blocks.num_used_blocks * sizes.block_bytes,
                "state_bytes_in_use": slots * sizes.slot_bytes}


def run(core, recorder, limit=500):
    for _ in range(limit):
        if not core.has_unfinished():
            return
        recorder(core, core.step(), 0.001)
    raise AssertionError("the engine did not finish")


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_chunked_prefill_and_decodes_are_recorded_per_step_and_per_request():
    core, rec = StandInCore(num_blocks=64, num_slots=4, budget=8), StepRecorder()
    core.add_request("a", list(range(1, 11)), greedy(4))  # 10 prompt tokens: chunks under a budget of 8
    core.add_request("b", list(range(20, 26)), greedy(3))
    run(core, rec)
    steps = rec.timeline()
    assert [s["step"] for s in steps] == list(range(rec.num_steps))
    assert all(s["tokens"] == sum(e["tokens"] for e in s["entries"]) <= 8 for s in steps)
    assert all(s["prefill_tokens"] + s["decode_tokens"] == s["tokens"] for s in steps)
    for rid, prompt, out in (("a", 10, 4), ("b", 6, 3)):
        hist = rec.positions(rid)
        assert sum(r["with_cache"] for r in hist) == prompt + out - 1  # the last token is never fed back
        assert [r["mode"] for r in hist].count("decode") == out - 1
        assert sum(r["with_cache"] for r in hist if r["mode"] == "prefill") == prompt
        assert [r["without_cache"] for r in hist] == [r["context"] + r["computed"] for r in hist]
        without = [r["without_cache"] for r in hist]
        assert all(x < y for x, y in zip(without, without[1:]))  # the whole prefix, one longer each step
    view = rec.view
    assert view["kv_blocks_used"] == 0 and view["state_slots_used"] == 0 and not view["requests"]
    done = {r["id"]: r for r in view["finished"]}
    assert done["a"]["computed"] == 13 and len(done["a"]["blocks"]) == math.ceil(13 / BS)
    assert done["b"]["computed"] == 8 and len(done["b"]["blocks"]) == 2
    assert {r["finish_reason"] for r in done.values()} == {"length"}
    totals = view["step_totals"]
    assert totals["prefill"]["tokens"] + totals["decode"]["tokens"] == 13 + 8
    assert view["snapshots"] == []  # prefix caching is off


def test_prefix_snapshots_appear_in_the_view():
    core = StandInCore(num_blocks=64, num_slots=6, budget=64, max_num_seqs=2, enable_prefix_caching=True)
    rec = StepRecorder()
    prompt = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    core.add_request("first", prompt, greedy(3))
    run(core, rec)
    snaps = rec.view["snapshots"]
    assert snaps and all(s["slot"] is not None and s["blocks"] == math.ceil(s["tokens"] / BS) for s in snaps)
    assert 9 in {s["tokens"] for s in snaps}  # the prompt's length - 1 (a repeat computes its last token)
    core.add_request("again", prompt + [50, 51], greedy(2))
    run(core, rec)
    assert sum(s["hits"] for s in rec.view["snapshots"]) >= 1
    first = rec.positions("again")[0]
    assert first["context"] >= 9 and first["without_cache"] == first["context"] + first["with_cache"]


def test_the_recompute_after_a_preemption_is_prefill_work():
    # 6 blocks of 4 tokens: two requests growing to 4 + 12 tokens each cannot both stay
    core, rec = StandInCore(num_blocks=6, num_slots=2, budget=64), StepRecorder()
    core.add_request("old", [1, 2, 3, 4], greedy(12))
    core.add_request("new", [5, 6, 7, 8], greedy(12))
    run(core, rec)
    preempted = [rid for rid in ("old", "new") if any(
        r["mode"] == "prefill" and r["context"] == 0 for r in rec.positions(rid)[1:])]
    assert preempted, "the pool was meant to force a preemption"
    for rid in preempted:
        hist = rec.positions(rid)
        again = next(i for i, r in enumerate(hist) if i and r["context"] == 0)
        assert hist[again - 1]["mode"] == "decode" and hist[again]["computed"] > 1
        assert hist[again]["without_cache"] == hist[again]["with_cache"]  # nothing cached: both recompute all


def test_step_modes_read_the_step_itself():
    step = SimpleNamespace(seqs=[SimpleNamespace(num_prompt_tokens=5)] * 3, num_tokens=[1, 5, 1],
                           context_lens=[5, 0, 3])
    assert step_modes(step) == ["decode", "prefill", "prefill"]  # the last: a 1-token prompt chunk
    step.drafts = {0: [4, 5]}
    step.num_tokens[0] = 3
    assert step_modes(step) == ["verify", "prefill", "prefill"]  # speculative decoding's verify entry


def test_prefix_snapshots_read_the_prefix_cache_when_there_is_one():
    snap = SimpleNamespace(num_tokens=40, slot=5, chain=(1, 2), partial_block=9, hits=3, last_used=2.0)
    old = SimpleNamespace(num_tokens=16, slot=6, chain=(1,), partial_block=None, hits=0, last_used=1.0)
    core = SimpleNamespace(scheduler=SimpleNamespace(prefix=SimpleNamespace(cache=SimpleNamespace(
        snapshots={"k1": old, "k2": snap}))))
    assert prefix_snapshots(core) == [
        {"tokens": 40, "slot": 5, "blocks": 3, "hits": 3, "last_used": 2.0},
        {"tokens": 16, "slot": 6, "blocks": 1, "hits": 0, "last_used": 1.0}]
    assert prefix_snapshots(SimpleNamespace(scheduler=SimpleNamespace(prefix=None))) == []
