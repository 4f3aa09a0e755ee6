"""The explorer's cache-against-context data: the planner's numbers for one model at one context.

The page draws what this returns and computes nothing itself: the `kvstate memory --json
--layers` object at the slider's context, the three curves of spec 002's chart (MHA on every
layer, the model's own GQA/MLA attention on every layer, the actual hybrid) sampled on the
slider's stops, and each layer's cache shape and bytes at that context for the layer bar.
No torch: it runs on the planner alone (kvstate.memory, kvstate.cache.spec, kvstate.memory_plot).
"""

from __future__ import annotations

from typing import Any, Mapping

from kvstate.cache.spec import CacheSpec, cache_spec
from kvstate.config.plan import KV_KINDS, ModelPlan
from kvstate.config.reader import bundled_names
from kvstate.families import read_plan
from kvstate.errors import KvstateError
from kvstate.memory import format_bytes, format_tokens, summary
from kvstate.memory_plot import hypothetical_curves

MIN_CONTEXT = 256
MAX_CONTEXT = 1 << 22  # 4M tokens: past every bundled model's window
DEFAULT_CONTEXT = 32768  # the walkthrough's 32K


def context_stops(plan: ModelPlan) -> list[int]:
    """The slider's stops: 1, 1.25, 1.5 and 1.75 times each power of two from 256 tokens up to
    the model's window (at least 128K, so models without a limit still get a long axis)."""
    hi = min(max(plan.max_position_embeddings or 0, 1 << 17), MAX_CONTEXT)
    stops, p = [], MIN_CONTEXT
    while p <= hi:
        stops += [t for t in (p, p * 5 // 4, p * 3 // 2, p * 7 // 4) if t <= hi]
        p *= 2
    if stops[-1] != hi:
        stops.append(hi)
    return stops



def curves(plan: ModelPlan, spec: CacheSpec, stops: list[int]) -> list[dict]:
    """[{label, kind, per_token, fixed, points: [[tokens, bytes], ...]}]: hypothetical models first."""
    out = []
    for label, per_token in hypothetical_curves(plan, spec.kv_dtype).items():
        kind = "mha" if label.startswith("MHA") else "gqa"
        out.append({"label": label, "kind": kind, "per_token": per_token, "fixed": 0,
                    "points": [[t, per_token * t] for t in stops]})
    kv_layers = sum(1 for layer in plan.layers if set(layer.kinds) & KV_KINDS)
    out.append({"label": f"{plan.name} (actual: KV in {kv_layers} of {plan.num_layers} layers)", "kind": "actual",
                "per_token": spec.kv_bytes_per_token, "fixed": spec.state_bytes,
                "points": [[t, spec.request_bytes(t)] for t in stops]})
    return out


def layer_rows(plan: ModelPlan, spec: CacheSpec, context: int) -> list[dict]:
    """Per decoder block: its letter, mixers, cache entries and bytes at `context` (KV grows, state is fixed)."""
    by_layer: dict[int, list] = {}
    for e in spec.entries:
        by_layer.setdefault(e.layer, []).append(e)
    rows = []
    for layer in plan.layers:
        entries = by_layer.get(layer.index, [])
        kv = sum(e.kv_bytes_per_token for e in entries) * context
        state = sum(e.state_bytes for e in entries)
        rows.append({"index": layer.index, "letter": layer.letter, "kinds": list(layer.kinds), "ffn": layer.ffn.kind,
                     "entries": [e.to_json() for e in entries],
                     "kv_tokens": context if kv else 0,  # the KV tensor's token dimension at this context
                     "kv_bytes": kv, "state_bytes": state, "bytes": kv + state, "human": format_bytes(kv + state)})
    return rows


def memory_view(plan: ModelPlan, *, context: int | None = None, kv_dtype: str | None = None,
                state_dtype: str | None = None) -> dict[str, Any]:
    """Everything the cache-against-context panel shows for `plan` at `context` tokens."""
    spec = cache_spec(plan, kv_dtype=kv_dtype, state_dtype=state_dtype)
    stops = context_stops(plan)
    if context is None:
        context = min(stops, key=lambda t: abs(t - DEFAULT_CONTEXT))
    if not 1 <= context <= MAX_CONTEXT:
        raise KvstateError(f"context must be between 1 and {MAX_CONTEXT} tokens, got {context}")
    lines = curves(plan, spec, stops)
    memory = summary(plan, spec, (context,))
    memory["per_layer"] = [e.to_json() for e in spec.entries]
    readings = [{"label": c["label"], "kind": c["kind"], "bytes": c["per_token"] * context + c["fixed"],
                 "human": format_bytes(c["per_token"] * context + c["fixed"])} for c in lines]
    return {"model": plan.name, "layer_string": plan.layer_string, "context": context,
            "context_label": format_tokens(context), "stops": stops, "memory": memory, "curves": lines,
            "readings": readings, "layers": layer_rows(plan, spec, context),
            "max_position_embeddings": plan.max_position_embeddings}


def plan_for(model: str | None, config: Mapping[str, Any] | None = None, loaded: ModelPlan | None = None) -> ModelPlan:
    """The plan of a bundled short name, an uploaded config dict, or "loaded" (the served model)."""
    if config is not None:
        if not isinstance(config, Mapping):
            raise KvstateError("config: expected the JSON object of a config.json")
        return read_plan(config, name=str(config.get("_name_or_path") or "uploaded config.json"))
    if model == "loaded":
        if loaded is None:
            raise KvstateError("no model is loaded by this server")
        return loaded
    if model is None or model.strip().lower() not in bundled_names():
        raise KvstateError(f"unknown model {model!r}; bundled: {', '.join(bundled_names())}")
    return read_plan(model)
