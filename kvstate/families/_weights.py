"""Mapping HF checkpoint tensor names to kvstate parameter names (no torch).

A family adapter's `weight_targets(name, plan)` returns, for one checkpoint tensor, a list of
`Target`s (where its rows go in our parameters), `[]` for a tensor we deliberately skip
(multi-token-prediction heads, vision towers), or None for a name it does not know (the loader
then reports it). Most names follow shared conventions, handled by `common_targets`.

Our names: embed_tokens.weight, norm.weight, lm_head.weight and per block
layers.{i}.input_norm / mixer.* / ffn_norm / ffn.* ; MoE FFNs hold ffn.gate.weight,
ffn.experts.gate_up [E, 2I, H] (or [E, I, H] when not gated), ffn.experts.down [E, H, I],
ffn.shared_experts.*, ffn.shared_expert_gate.weight.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Target:
    name: str  # our parameter (or buffer) name
    index: tuple = ()  # where in that parameter the source goes (ints and slices)
    rows: slice | tuple[int, ...] | None = None  # which rows (dim 0) of the source tensor; None: all


Rules = Sequence[tuple[str, str]]

# (HF regex, our name template); applied to the name after the layer prefix is normalized.
COMMON_RULES: Rules = (
    (r"embed_tokens\.weight", "embed_tokens.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"norm\.weight", "norm.weight"),
    (r"layers\.(\d+)\.input_layernorm\.weight", r"layers.\1.input_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.self_attn\.(\w+)\.(weight|bias)", r"layers.\1.mixer.\2.\3"),
    (r"layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)", r"layers.\1.ffn.\2.\3"),
    (r"layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.ffn.gate.weight"),
    (r"layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", r"layers.\1.ffn.gate.e_score_correction_bias"),
    (r"layers\.(\d+)\.mlp\.shared_experts?\.(\w+)\.(weight|bias)", r"layers.\1.ffn.shared_experts.\2.\3"),
    (r"layers\.(\d+)\.mlp\.shared_expert_gate\.weight", r"layers.\1.ffn.shared_expert_gate.weight"),
    (r"layers\.(\d+)\.mlp\.experts\.gate_up_proj", r"layers.\1.ffn.experts.gate_up"),
    (r"layers\.(\d+)\.mlp\.experts\.down_proj", r"layers.\1.ffn.experts.down"),
)

_EXPERT = re.compile(r"layers\.(\d+)\.(?:mlp|feed_forward|mixer)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight")


def strip_prefix(name: str, prefixes: Sequence[str]) -> str:
    for p in prefixes:
        if name.startswith(p):
            return name[len(p):]
    return name


def apply_rules(name: str, rules: Rules) -> str | None:
    for pattern, template in rules:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, template, name)
    return None


def expert_target(name: str, ffn_of, *, gated: bool = True) -> list[Target] | None:
    """Per-expert tensors (layers.L.mlp.experts.E.{gate,up,down}_proj.weight) -> rows of the fused ones.

    `ffn_of(layer)` gives that layer's FfnSpec (for the expert width I)."""
    m = _EXPERT.fullmatch(name)
    if not m:
        return None
    layer, expert, which = int(m[1]), int(m[2]), m[3]
    width = ffn_of(layer).expert_intermediate_size
    base = f"layers.{layer}.ffn.experts"
    if which in ("down_proj", "w2"):
        return [Target(f"{base}.down", (expert,))]
    if not gated:  # plain experts: up only
        return [Target(f"{base}.gate_up", (expert,))]
    half = slice(0, width) if which in ("gate_proj", "w1") else slice(width, 2 * width)
    return [Target(f"{base}.gate_up", (expert, half))]


def common_targets(name: str, plan, *, prefixes: Sequence[str] = ("model.",), extra_rules: Rules = (),
                   skip: Sequence[str] = ()) -> list[Target] | None:
    """Targets for names that follow the shared conventions (after family-specific `extra_rules`)."""
    if any(re.match(p, name) for p in skip):
        return []
    short = strip_prefix(name, prefixes)
    ours = apply_rules(short, tuple(extra_rules) + tuple(COMMON_RULES))
    if ours is not None:
        return [Target(ours)]
    gated = {i: layer.ffn for i, layer in enumerate(plan.layers)}
    m = _EXPERT.fullmatch(short)
    if m:
        return expert_target(short, gated.__getitem__, gated=gated[int(m[1])].gated)
    return None
