"""Each rank's layer plan under tensor parallelism (no torch): the planner's and the cache spec's view.

`shard_plan(plan, tp, rank)` divides what Megatron-style TP divides: attention query heads and KV
heads (KV heads are replicated, one per rank, where there are fewer than ranks), MLA's query heads
(its latent cache is replicated), Gated DeltaNet's key and value heads, KDA's heads, Mamba-2's
heads (and its B/C groups, replicated where fewer than ranks), Mamba-1's inner channels, the MLP
width, the routed experts and the shared expert's width, and the vocabulary rows of the embedding
and LM head (uneven: the last rank may hold fewer). The cache spec of the rank's plan is then the
rank's cache (`kvstate.cache.spec.cache_spec`), so pools and planner agree by construction.
`tp_problems` lists, one line each, what does not divide by `tp`.
"""

from __future__ import annotations

from dataclasses import replace

from kvstate.config.plan import (AttentionSpec, FfnSpec, GatedDeltaNetSpec, KDASpec, Mamba1Spec, Mamba2Spec,
                                 MLASpec, ModelPlan)
from kvstate.errors import KvstateError


def _divides(what: str, n: int, tp: int) -> str | None:
    return None if n % tp == 0 else f"{what} = {n} does not divide by --tp {tp}"


def _spread(what: str, n: int, tp: int) -> str | None:
    """n % tp == 0 (split) or tp % n == 0 (replicated, one per rank) is fine."""
    return None if n % tp == 0 or tp % n == 0 else f"{what} = {n}: neither divides by nor divides --tp {tp}"


def _mixer_problems(m, tp: int) -> list[str | None]:
    if isinstance(m, AttentionSpec):
        return [_divides("attention heads", m.num_heads, tp), _spread("attention KV heads", m.num_kv_heads, tp)]
    if isinstance(m, MLASpec):
        return [_divides("MLA heads", m.num_heads, tp)]
    if isinstance(m, GatedDeltaNetSpec):
        return [_divides("Gated DeltaNet key heads", m.num_k_heads, tp),
                _divides("Gated DeltaNet value heads", m.num_v_heads, tp)]
    if isinstance(m, KDASpec):
        return [_divides("KDA heads", m.num_heads, tp)]
    if isinstance(m, Mamba2Spec):
        return [_divides("Mamba-2 heads", m.num_heads, tp), _spread("Mamba-2 groups", m.n_groups, tp)]
    if isinstance(m, Mamba1Spec):
        return [_divides("Mamba-1 inner channels", m.d_inner, tp)]
    return [f"{m.kind} mixers are not sharded"]


def tp_problems(plan: ModelPlan, tp: int) -> list[str]:
    """One line per distinct thing of `plan` that does not shard over `tp` ranks ([] if all do)."""
    if tp < 1:
        return [f"--tp must be >= 1, got {tp}"]
    if tp == 1:
        return []
    out: list[str] = []
    for layer in plan.layers:
        if len(layer.mixers) > 1:
            out.append(f"layer {layer.index} runs {len(layer.mixers)} mixers side by side, which TP does not shard")
        for m in layer.mixers:
            out += [p for p in _mixer_problems(m, tp) if p]
        f = layer.ffn
        if f.kind == "mlp":
            out.append(_divides("MLP width", f.intermediate_size, tp))
        elif f.kind == "moe":
            out += [_divides("routed experts", f.num_experts, tp),
                    f.shared_intermediate_size and _divides("shared expert width", f.shared_intermediate_size, tp)]
    return list(dict.fromkeys(p for p in out if p))  # each once, in order


def vocab_range(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, stop) of the vocabulary rows rank `rank` holds: ceil(vocab / tp) each, the last one fewer."""
    per = -(-vocab // tp)
    return min(vocab, rank * per), min(vocab, (rank + 1) * per)


def _local_mixer(m, tp: int):
    if isinstance(m, AttentionSpec):
        return replace(m, num_heads=m.num_heads // tp, num_kv_heads=max(1, m.num_kv_heads // tp))
    if isinstance(m, (MLASpec, KDASpec)):
        return replace(m, num_heads=m.num_heads // tp)
    if isinstance(m, GatedDeltaNetSpec):
        return replace(m, num_k_heads=m.num_k_heads // tp, num_v_heads=m.num_v_heads // tp)
    if isinstance(m, Mamba2Spec):
        return replace(m, num_heads=m.num_heads // tp, n_groups=max(1, m.n_groups // tp))
    return replace(m, d_inner=m.d_inner // tp)  # Mamba1Spec


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
        mixers = tuple(_local_mixer(m, tp) for m in layer.mixers)
        ffn = _local_ffn(layer.ffn, tp)
        for m, loc in zip(layer.mixers, mixers):
            kind = "attention" if isinstance(m, (AttentionSpec, MLASpec)) else "linear"
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
