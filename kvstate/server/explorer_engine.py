"""The explorer's view of the running engine: a step recorder called by the server's engine loop.

`StepRecorder` is one of `EngineLoop.step_observers`: after every `EngineCore.step()`, on the
engine thread (so it reads the scheduler between steps, never in the middle of one), it keeps

- one timeline record per step: wall milliseconds, tokens computed, split into prefill tokens
  (prompt chunks, recompute after preemption) and decode tokens (one new position of a request
  that has produced output), from the step's own SchedulerOutput (`core.last_step`);
- per engine request, the positions each step computed for it (the cache-on/off panel);
- a view of the pools: each request's KV block table (blocks fill one token at a time) next to
  its one fixed state slot, pool occupancy, the engine's counters (prefix-cache figures when
  `EngineCore.stats()` reports them), the prefix cache's state snapshots, and the requests
  finished last.

Readers on other threads only ever get the latest immutable snapshot (a dict replaced whole).
No torch.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

STANDARD_STATS = ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "state_slots_used",
                  "state_slots_total", "kv_bytes_in_use", "state_bytes_in_use", "kv_blocks_held", "state_slots_held")


def _request_row(seq, computed: int, blocks: list[int], slot, status: str) -> dict:
    return {"id": str(seq.request_id), "status": status, "prompt_tokens": seq.num_prompt_tokens,
            "output_tokens": seq.num_output_tokens, "computed": computed, "blocks": list(blocks), "slot": slot,
            "preemptions": seq.num_preemptions}


def step_modes(step) -> list[str]:
    """"decode", "verify" or "prefill" for each entry of a SchedulerOutput: decode is one new position
    of a request past its prompt, verify a decode with draft tokens (speculative decoding: the step's
    `drafts`); everything else (prompt chunks, the recompute after a preemption) is prefill work."""
    drafts = getattr(step, "drafts", None) or {}
    return ["verify" if i in drafts else "decode" if n == 1 and ctx >= seq.num_prompt_tokens else "prefill"
            for i, (seq, n, ctx) in enumerate(zip(step.seqs, step.num_tokens, step.context_lens))]


def prefix_snapshots(core, limit: int = 64) -> list[dict]:
    """The prefix cache's state snapshots (engine/prefix_cache.py), newest first: the position each
    holds, its state slot, the KV blocks it keeps, its hits. Empty when prefix caching is off."""
    cache = getattr(getattr(core.scheduler, "prefix", None), "cache", None)
    held = getattr(cache, "snapshots", None)
    if not isinstance(held, dict):
        return []
    rows = [{"tokens": s.num_tokens, "slot": s.slot, "blocks": len(s.chain) + (s.partial_block is not None),
             "hits": s.hits, "last_used": s.last_used} for s in held.values()]
    return sorted(rows, key=lambda r: -r["last_used"])[:limit]


def cache_reports(core, limit: int = 8) -> list[dict]:
    """The cache reports of the last finished requests, newest first (kvstate.engine.cache_report):
    what each reused and why reuse stopped where it did."""
    rows = [{"request_id": str(rid), **report.to_dict()} for rid, report in getattr(core, "cache_reports", ())]
    return rows[::-1][:limit]


POOL_DIMS = {("k", None): "num_blocks, block_size, kv_heads, head_dim",
             ("v", None): "num_blocks, block_size, kv_heads, head_dim",
             ("latent", None): "num_blocks, block_size, latent_dim",
             ("state", "gated_deltanet"): "num_slots, heads, k_dim, v_dim",
             ("state", "kda"): "num_slots, heads, k_dim, v_dim",
             ("state", "mamba2"): "num_slots, heads, d_state, head_dim",
             ("state", "mamba1"): "num_slots, d_inner, d_state",
             ("conv", None): "num_slots, conv_dim, window"}


def pool_tensors(core) -> list[dict]:
    """The real pool tensors of the first attention layer and the first linear layer: name, layer,
    shape and dtype (a KV block pool is indexed by block id and position in the block, not a dict)."""
    spec = getattr(core.runner, "cache_spec", None)  # a stand-in core (tests) may have neither spec nor pools
    kinds = {e.layer: e.kind for e in spec.entries} if spec is not None else {}
    out = []
    for key in ("k", "v", "latent", "state", "conv"):
        for layer, cache in enumerate(getattr(core.runner, "caches", None) or []):
            t = getattr(cache, key, None)
            if t is not None:
                dims = POOL_DIMS.get((key, kinds.get(layer)), POOL_DIMS.get((key, None), ""))
                out.append({"name": key, "layer": layer, "kind": kinds.get(layer), "shape": list(t.shape),
                            "dims": dims, "dtype": str(t.dtype).removeprefix("torch.")})
                break
    return out


class StepRecorder:
    def __init__(self, *, max_steps: int = 400, max_finished: int = 8, max_requests: int = 256):
        self.steps: deque[dict] = deque(maxlen=max_steps)
        self.num_steps = 0
        self.history: OrderedDict[str, list[dict]] = OrderedDict()  # request id -> per-step records
        self.max_requests = max_requests
        self.finished: deque[dict] = deque(maxlen=max_finished)
        self._last_seen: OrderedDict[str, dict] = OrderedDict()  # request id -> its row at its last step
        self.view: dict | None = None
        # since the start, by step kind (a step with any prefill work counts as a prefill step)
        self.totals = {kind: {"steps": 0, "tokens": 0, "ms": 0.0} for kind in ("prefill", "decode")}

    # -- on the engine thread ---------------------------------------------------------------------
    def __call__(self, core, outputs, seconds: float) -> None:
        step = core.last_step
        if step is not None and not step.is_empty:
            self._record(step, seconds)
        for out in outputs:
            if out.finished:
                rid = str(out.request_id)
                row = self._last_seen.pop(rid, None)
                if row is not None:
                    reason = out.output.outputs[0].finish_reason if out.output and out.output.outputs else None
                    self.finished.appendleft({**row, "status": "finished", "finish_reason": reason})
        self.view = self.snapshot(core)

    def _record(self, step, seconds: float) -> None:
        modes = step_modes(step)
        index = self.num_steps
        self.num_steps += 1
        entries = []
        for seq, n, ctx, table, slot, mode in zip(step.seqs, step.num_tokens, step.context_lens,
                                                 step.block_tables, step.state_slots, modes):
            rid = str(seq.request_id)
            entries.append({"id": rid, "tokens": n, "mode": mode})
            self._last_seen[rid] = _request_row(seq, ctx + n, table, slot, "running")  # blocks before release
            self._last_seen.move_to_end(rid)
            record = {"step": index, "computed": n, "context": ctx, "mode": mode, "ms": seconds * 1e3}
            self.history.setdefault(rid, []).append(record)
            self.history.move_to_end(rid)
        for seen in (self.history, self._last_seen):  # bounded: requests failed outside a step never finish here
            while len(seen) > self.max_requests:
                seen.popitem(last=False)
        prefill = sum(e["tokens"] for e in entries if e["mode"] == "prefill")
        total = self.totals["prefill" if prefill else "decode"]
        total["steps"] += 1
        total["tokens"] += step.total_tokens
        total["ms"] += seconds * 1e3
        self.steps.append({"step": index, "time": time.time(), "ms": seconds * 1e3, "tokens": step.total_tokens,
                           "prefill_tokens": prefill, "decode_tokens": step.total_tokens - prefill,
                           "entries": entries})

    def snapshot(self, core) -> dict:
        """The engine view now (call between steps: on the engine thread, or before it starts)."""
        s, sizes = core.scheduler, core.runner.sizes
        stats = core.stats()
        running = [_request_row(q, q.num_computed_tokens, q.block_table, q.state_slot, "running") for q in s.running]
        waiting = [_request_row(q, q.num_computed_tokens, q.block_table, q.state_slot, "waiting") for q in s.waiting]
        return {"block_size": s.config.block_size, "block_bytes": sizes.block_bytes, "slot_bytes": sizes.slot_bytes,
                "kv_blocks_total": sizes.num_blocks, "kv_blocks_used": stats["kv_blocks_used"],
                "state_slots_total": sizes.num_slots, "state_slots_used": stats["state_slots_used"],
                "kv_blocks_held": stats.get("kv_blocks_held", 0), "state_slots_held": stats.get("state_slots_held", 0),
                "kv_bytes_in_use": stats["kv_bytes_in_use"], "state_bytes_in_use": stats["state_bytes_in_use"],
                "max_model_len": core.max_model_len, "requests": running + waiting,
                "finished": list(self.finished), "num_steps": self.num_steps,
                "step_totals": {k: dict(v) for k, v in self.totals.items()}, "snapshots": prefix_snapshots(core),
                "cache_reports": cache_reports(core),
                "counters": {k: v for k, v in stats.items() if k not in STANDARD_STATS},
                "pool_tensors": pool_tensors(core)}

    # -- on any thread ----------------------------------------------------------------------------
    def timeline(self, since: int = -1) -> list[dict]:
        """Step records with index > `since` (oldest first)."""
        return [r for r in list(self.steps) if r["step"] > since]

    def positions(self, request_id: str) -> list[dict]:
        """The per-step records of one engine request: positions computed with the cache, and the
        positions a model without a cache recomputes at the same step (the whole prefix so far)."""
        rows = []
        for r in list(self.history.get(str(request_id), ())):
            rows.append({**r, "with_cache": r["computed"], "without_cache": r["context"] + r["computed"]})
        return rows


def served_loop(request):
    """The server's engine loop, for explorer routes that run the served model on text; ApiError
    (409) when no model is loaded or its checkpoint has no tokenizer."""
    from kvstate.server.protocol import ApiError

    loop = getattr(request.app.state, "engine_loop", None)
    if loop is None:
        raise ApiError("no model is loaded by this server", status=409)
    if loop.core.tokenizer is None:
        raise ApiError("the served checkpoint has no tokenizer.json: the explorer needs one for text prompts",
                       status=409)
    return loop


async def run_greedy(loop, rec: StepRecorder, ids: list[int], max_tokens: int):
    """Run `ids` greedily for `max_tokens` through the server's engine loop; (the finished
    RequestOutput, the steps the recorder saw of it, its engine request id). Raises ApiError when it did not finish."""
    from kvstate.engine.params import SamplingParams
    from kvstate.server.protocol import ApiError

    sub = loop.submit([(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))])
    final = None
    async with sub:
        async for _, out in sub:
            if out.finished:
                final = out.output
    if final is None or final.error:
        raise ApiError(final.error if final is not None else "the request did not finish")
    return final, rec.positions(sub.request_ids[0]), sub.request_ids[0]
