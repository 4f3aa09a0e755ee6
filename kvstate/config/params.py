"""Parameter-count estimate from a layer plan (for `kvstate memory --gpu-memory`).

Each mixer kind counts its own weights (`MixerSpec.params`, kvstate.config.mixers); here: the
blocks' norms, each FFN (dense, routed experts + router + shared experts) and the embeddings.
Tests hold the totals to transformers' own models instantiated on the meta device.
"""

from __future__ import annotations

from kvstate.config.plan import KV_KINDS, FfnSpec, LayerSpec, ParamEstimate


def ffn_params(f: FfnSpec, hidden: int) -> tuple[int, int]:
    """(dense MLP weights, MoE weights) of one FFN."""
    mats = 3 if f.gated else 2
    if f.kind == "mlp":
        return mats * hidden * f.intermediate_size, 0
    if f.kind == "moe":
        width = f.latent_size or hidden  # latent MoE: experts between hidden -> latent -> hidden projections
        experts = f.num_experts * mats * width * f.expert_intermediate_size + 2 * hidden * f.latent_size
        router = hidden * f.num_experts
        shared = mats * hidden * f.shared_intermediate_size
        return 0, experts + router + shared
    return 0, 0


def estimate_params(layers: tuple[LayerSpec, ...], hidden: int, vocab: int, tied: bool,
                    extra_attention: int = 0, extra_linear: int = 0, extra_moe: int = 0) -> ParamEstimate:
    """Sum the plan's weights. Each block also has its pre-mixer and pre-FFN RMSNorm weights,
    counted with the mixers; the `extra_*` terms carry family specifics (e.g. Qwen's q/k norms)."""
    attention = linear = mlp = moe = 0
    for layer in layers:
        norms = hidden * (int(bool(layer.mixers)) + int(layer.ffn.kind != "none"))
        for m in layer.mixers:
            if m.kind in KV_KINDS:
                attention += m.params(hidden)
            else:
                linear += m.params(hidden)
        dense, experts = ffn_params(layer.ffn, hidden)
        mlp, moe = mlp + dense, moe + experts
        if any(m.kind in KV_KINDS for m in layer.mixers):
            attention += norms
        else:
            linear += norms
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # embed, lm_head, final norm
    return ParamEstimate(attention + extra_attention, linear + extra_linear, mlp, moe + extra_moe, embeddings)
