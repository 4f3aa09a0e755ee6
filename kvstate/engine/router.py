"""User requests as engine requests: the n-sample fan-out, and each output routed back (no torch).

A prompt with n samples is n engine requests, sample k seeded seed + k (vLLM's rule). Whoever
steps the engine (`LLM`, the server's engine loop) hands every output of `EngineCore.step()` to
`RequestRouter.route`, which puts it into the sink of the request it belongs to with the choice
it is there (`sink.put(choice, out)`): `LLM`'s per-prompt RequestCollector, the server's
per-HTTP-request Submission. An output of a request no sink asked for (aborted, or added to the
core directly) is dropped.
"""

from __future__ import annotations

from kvstate.engine.params import SamplingParams


def fan_out(request_id, params: SamplingParams, first_choice: int = 0) -> list[tuple[object, int, SamplingParams]]:
    """(engine request id, choice, params) of each of the `params.n` samples of one prompt: the id
    itself for one sample, (id, k) for sample k of more; choices first_choice .. first_choice + n - 1.
    Params that are not SamplingParams go through as one request (the core reports them)."""
    if not isinstance(params, SamplingParams) or params.n == 1:
        return [(request_id, first_choice, params)]
    return [((request_id, k), first_choice + k, params.for_sample(k)) for k in range(params.n)]


class RequestRouter:
    """Engine request id -> (sink, choice), for the requests added through it and not finished yet."""

    def __init__(self, core):
        self.core = core
        self.routes: dict[object, tuple[object, int]] = {}

    def add(self, sink, request_id, choice: int, prompt_ids, params: SamplingParams, *, group=None,
            snapshot_hints: dict[int, str] | None = None, cache_salt: str | None = None) -> None:
        """Queue one engine request (n = 1: see `fan_out`) whose outputs go to `sink` as `choice`."""
        extra = {"group": group} if group is not None else {}
        extra.update({"snapshot_hints": snapshot_hints} if snapshot_hints else {})
        extra.update({"cache_salt": cache_salt} if cache_salt else {})
        self.core.add_request(request_id, prompt_ids, params, **extra)
        self.routes[request_id] = (sink, choice)

    def route(self, outs) -> list:
        """Put each output into its sink (a finished request leaves the table); the sinks fed, in order."""
        fed: dict[int, object] = {}
        for out in outs:
            route = self.routes.get(out.request_id)
            if route is None:
                continue
            route[0].put(route[1], out)
            fed.setdefault(id(route[0]), route[0])
            if out.finished:
                del self.routes[out.request_id]
        return list(fed.values())

    def drop(self, request_ids) -> list[tuple[object, object, int]]:
        """Take those of `request_ids` still routed out of the table (their later outputs are not
        routed; the core is not told). -> (request id, sink, choice) of each."""
        return [(rid, *route) for rid in list(request_ids) if (route := self.routes.pop(rid, None)) is not None]

    def abort(self, request_ids) -> list[tuple[object, object, int]]:
        """Stop those of `request_ids` still routed: out of the table first (their final outputs are
        not routed), then aborted in the core. -> (request id, sink, choice) of each one stopped."""
        stopped = self.drop(request_ids)
        for rid, _, _ in stopped:
            self.core.abort_request(rid)
        return stopped

    def of(self, sinks) -> list:
        """The unfinished engine requests of any of `sinks`."""
        mine = {id(s) for s in sinks}
        return [rid for rid, (s, _) in self.routes.items() if id(s) in mine]
