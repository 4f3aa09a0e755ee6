"""Each rank's layer plan under tensor parallelism (no torch): the planner's and the cache spec's view.

`shard_plan(plan, tp, rank)` divides what Megatron-style TP divides: each mixer as its kind says
(`tp_local`, kvstate.config.mixers: attention and MLA query heads, KV heads replicated where fewer
than ranks, the linear mixers' heads or channels; every mixer of a block that holds several), the
MLP width, the routed experts and the shared expert's width, and the vocabulary rows of the
embedding and LM head (uneven: the last rank may hold fewer). The cache spec of the rank's plan is then the
rank's cache (`kvstate.cache.spec.cache_spec`), so pools and planner agree by construction.
`tp_problems` lists, one line each, what does not divide by `tp`.
"""

from __future__ import annotations

from dataclasses import replace

from kvstate.config.cuts import divides
from kvstate.config.plan import KV_KINDS, FfnSpec, ModelPlan
from kvstate.errors import KvstateError


def tp_problems(plan: ModelPlan, tp: int) -> list[str]:
    """One line per distinct thing of `plan` that does not shard over `tp` ranks ([] if all do)."""
    if tp < 1:
        return [f"--tp must be >= 1, got {tp}"]
    if tp == 1:
        return []
    out: list[str] = []
    for layer in plan.layers:
        for m in layer.mixers:
            out += m.tp_problems(tp)
        f = layer.ffn
        if f.kind == "mlp":
            out.append(divides("MLP width", f.intermediate_size, tp))
        elif f.kind == "moe":
            out += [divides("routed experts", f.num_experts, tp),
                    f.shared_intermediate_size and divides("shared expert width", f.shared_intermediate_size, tp)]
    return list(dict.fromkeys(p for p in out if p))  # each once, in order


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows rank `rank` holds: ceil(vocab / tp) each, the last one fewer."""
    per = -(-vocab // tp)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def _local_ffn(f: FfnSpec, tp: int) -> FfnSpec:
    if f.kind == "mlp":
        return replace(f, intermediate_size=f.intermediate_size // tp)
    if f.kind == "moe":
        return replace(f, num_experts=f.num_experts // tp, shared_intermediate_size=f.shared_intermediate_size // tp)
    return f


def shard_plan(plan: ModelPlan, tp: int, rank: int = 0) -> ModelPlan:
    """Rank `rank`'s plan of `plan` over `tp` ranks (the plan itself at tp 1); KvstateError naming
    what does not divide. Its `params` are the rank's parameter count (replicated parts in full)."""
    if tp == 1:
        return plan
    problems = tp_problems(plan, tp)
    if problems:
        raise KvstateError(f"{plan.name}: cannot shard over --tp {tp}: {'; '.join(problems)}")
    if not 0 <= rank < tp:
        raise KvstateError(f"rank {rank} is not in 0..{tp - 1}")
    hidden = plan.hidden_size
    layers, cut = [], {"attention": 0, "linear": 0, "mlp": 0, "moe": 0}
    for layer in plan.layers:
        mixers = tuple(m.tp_local(tp) for m in layer.mixers)
        ffn = _local_ffn(layer.ffn, tp)
        for m, loc in zip(layer.mixers, mixers):
            kind = "attention" if m.kind in KV_KINDS else "linear"
            cut[kind] += m.params(hidden) - loc.params(hidden)
        (mlp, moe), (mlp_l, moe_l) = layer.ffn.params(hidden), ffn.params(hidden)
        router_kept = hidden * (layer.ffn.num_experts - ffn.num_experts)  # the router stays whole
        cut["mlp"] += mlp - mlp_l
        cut["moe"] += moe - moe_l - router_kept
        layers.append(replace(layer, mixers=mixers, ffn=ffn))
    start, stop = vocab_range(plan.vocab_size, tp, rank)
    vocab = stop - start
    tables = 1 if plan.tie_word_embeddings else 2
    p = plan.params
    params = replace(p, attention=p.attention - cut["attention"], linear_mixers=p.linear_mixers - cut["linear"],
                     mlp=p.mlp - cut["mlp"], moe_experts=p.moe_experts - cut["moe"],
                     embeddings=p.embeddings - tables * hidden * (plan.vocab_size - vocab))
    return replace(plan, name=f"{plan.name} (rank {rank}/{tp})", vocab_size=vocab, layers=tuple(layers), params=params)
