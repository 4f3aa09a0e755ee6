"""The request router and request checks that LLM and the server share (no torch, no model)."""

from types import SimpleNamespace

from kvstate.engine.outputs import EngineOutput
from kvstate.engine.params import SamplingParams
from kvstate.engine.request_check import prompt_tokens, stop_tokens_problem
from kvstate.engine.router import RequestRouter, fan_out


class Core:
    def __init__(self):
        self.added, self.aborted = [], []

    def add_request(self, rid, ids, params, **kw):
        self.added.append((rid, params, kw))

    def abort_request(self, rid):
        self.aborted.append(rid)


class Sink:
    def __init__(self):
        self.got = []

    def put(self, choice, out):
        self.got.append((choice, out.request_id, out.finished))


def test_fan_out_gives_each_sample_its_id_choice_and_seed():
    one = SamplingParams(seed=5)
    assert fan_out("r", one, 3) == [("r", 3, one)]
    many = fan_out("r", SamplingParams(n=3, seed=5), 6)
    assert [(rid, c, p.n, p.seed) for rid, c, p in many] == [(("r", 0), 6, 1, 5), (("r", 1), 7, 1, 6),
                                                             (("r", 2), 8, 1, 7)]
    assert fan_out("r", None) == [("r", 0, None)]  # the core reports params that are not SamplingParams


def test_the_router_routes_outputs_to_their_sinks_and_aborts_only_what_runs():
    core, a, b = Core(), Sink(), Sink()
    router = RequestRouter(core)
    router.add(a, "x", 0, [1], SamplingParams())
    router.add(b, "y", 1, [2], SamplingParams(), group="g", snapshot_hints={1: "chat"}, cache_salt="s")
    assert core.added[0][2] == {} and core.added[1][2] == {"group": "g", "snapshot_hints": {1: "chat"},
                                                           "cache_salt": "s"}
    fed = router.route([EngineOutput("x", [3], "", True), EngineOutput("y", [4], "", False),
                        EngineOutput("stranger", [5], "", False)])
    assert fed == [a, b] and a.got == [(0, "x", True)] and b.got == [(1, "y", False)]
    assert router.of([a]) == [] and router.of([a, b]) == ["y"]
    assert router.abort(["x", "y"]) == [("y", b, 1)] and core.aborted == ["y"]  # x had finished
    router.route([EngineOutput("y", [], "", True)])  # the aborted request's final output reaches no one
    assert b.got == [(1, "y", False)]


def test_one_set_of_token_checks():
    assert prompt_tokens([1, 2], 10) == ([1, 2], None)
    assert prompt_tokens([1, 10], 10) == ([1, 10], "prompt token 1 is 10, outside the vocabulary [0, 10)")
    assert prompt_tokens([True], 10)[1] == "prompt token 0 is True, not an integer token id"
    assert stop_tokens_problem([3], 10) is None
    assert stop_tokens_problem([-1, 10, 11, 12, 13, 14], 10) == \
        "stop_token_ids [-1, 10, 11, 12] and 2 more are outside the vocabulary [0, 10)"


def test_llm_and_server_ask_the_core_whether_prefix_caching_is_on():
    from kvstate.engine.core import EngineCore

    core = EngineCore.__new__(EngineCore)
    core.scheduler = SimpleNamespace(prefix=None)
    assert core.prefix_caching is False
    core.scheduler = SimpleNamespace(prefix=object())
    assert core.prefix_caching is True
