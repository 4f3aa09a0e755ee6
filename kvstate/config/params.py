"""Parameter-count estimate from a layer plan (for `kvstate memory --gpu-memory`).

Each mixer kind counts its own weights (`MixerSpec.params`, kvstate.config.mixers) and each FFN
its own (`FfnSpec.params`: dense, routed experts + router + shared expert); the family facts
(q/k norms, biases, gates, inner norms) are fields of those kinds. Here: their sum, the blocks'
norms and the embeddings. Tests hold the totals to transformers' own models on the meta device.
"""

from __future__ import annotations

from kvstate.config.plan import KV_KINDS, LayerSpec, ParamEstimate


def estimate_params(layers: tuple[LayerSpec, ...], hidden: int, vocab: int, tied: bool) -> ParamEstimate:
    """Sum the plan's weights. Each block also has its pre-mixer and pre-FFN RMSNorm weights,
    counted with its mixers (with attention if it has any)."""
    attention = linear = mlp = moe = 0
    for layer in layers:
        norms = hidden * (int(bool(layer.mixers)) + int(layer.ffn.kind != "none"))
        for m in layer.mixers:
            if m.kind in KV_KINDS:
                attention += m.params(hidden)
            else:
                linear += m.params(hidden)
        dense, experts = layer.ffn.params(hidden)
        mlp, moe = mlp + dense, moe + experts
        if any(m.kind in KV_KINDS for m in layer.mixers):
            attention += norms
        else:
            linear += norms
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # embed, lm_head, final norm
    return ParamEstimate(attention, linear, mlp, moe, embeddings)
