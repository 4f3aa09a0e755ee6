"""The explorer's step recorder without torch: the real EngineCore.step over the real scheduler with
a stand-in runner (it samples token 7 for every row), so each step's SchedulerOutput is the one
the recorder reads through `core.last_step`. Chunked prefill, decode and the recompute after a
preemption are told apart; each request's positions add up; finished rows keep their blocks."""

import math
from types import SimpleNamespace

from kvstate.engine.block_manager import PoolSizes
from kvstate.engine.core import EngineCore
from kvstate.engine.params import SamplingParams
from kvstate.engine.scheduler import Scheduler, SchedulerConfig
from kvstate.server.explorer_engine import StepRecorder, prefix_snapshots, step_modes

BS = 4


class StandInRunner:
    def __init__(self, sizes):
        self.sizes = sizes

    def execute(self, step):
        rows = step.sample_indices
        return SimpleNamespace(token_ids=[7] * len(rows), logprobs=[None] * len(rows), top_logprobs=[None] * len(rows))


class TorchFreeCore(EngineCore):
    """EngineCore's own step(), stats() and bookkeeping over a stand-in runner."""

    def __init__(self, num_blocks: int, num_slots: int, budget: int):
        self.plan, self.tokenizer, self.max_model_len = None, None, 64
        self.runner = StandInRunner(PoolSizes(num_blocks, num_slots, block_bytes=BS * 10, slot_bytes=1000))
        self.scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BS, num_slots=num_slots,
                                                   max_model_len=64, vocab_size=100, max_num_seqs=num_slots,
                                                   max_num_batched_tokens=budget))
        self.peak_cache_bytes = {"kv": 0, "state": 0}
        self.last_step = None
        self._sent = {}


def run(core, recorder, limit=500):
    for _ in range(limit):
        if not core.has_unfinished():
            return
        recorder(core, core.step(), 0.001)
    raise AssertionError("the engine did not finish")


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_chunked_prefill_and_decodes_are_recorded_per_step_and_per_request():
    core, rec = TorchFreeCore(num_blocks=64, num_slots=4, budget=8), StepRecorder()
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


def test_the_recompute_after_a_preemption_is_prefill_work():
    # 6 blocks of 4 tokens: two requests growing to 4 + 12 tokens each cannot both stay
    core, rec = TorchFreeCore(num_blocks=6, num_slots=2, budget=64), StepRecorder()
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


def test_prefix_snapshots_read_the_prefix_cache_when_there_is_one():
    snap = SimpleNamespace(num_tokens=40, slot=5, chain=(1, 2), partial_block=9, hits=3, last_used=2.0)
    old = SimpleNamespace(num_tokens=16, slot=6, chain=(1,), partial_block=None, hits=0, last_used=1.0)
    core = SimpleNamespace(scheduler=SimpleNamespace(prefix=SimpleNamespace(cache=SimpleNamespace(
        snapshots={"k1": old, "k2": snap}))))
    assert prefix_snapshots(core) == [
        {"tokens": 40, "slot": 5, "blocks": 3, "hits": 3, "last_used": 2.0},
        {"tokens": 16, "slot": 6, "blocks": 1, "hits": 0, "last_used": 1.0}]
    assert prefix_snapshots(SimpleNamespace(scheduler=SimpleNamespace(prefix=None))) == []
