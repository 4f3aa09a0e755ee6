"""Parameter-count estimate from a layer plan (for `kvstate memory --gpu-memory`).

Counts the projections, convolutions, per-head vectors and norms of each mixer as transformers
builds them, each FFN (dense, routed experts + router + shared experts) and the embeddings.
Tests hold the totals to transformers' own models instantiated on the meta device.
"""

from __future__ import annotations

from kvstate.config.plan import (
    AttentionSpec,
    FfnSpec,
    GatedDeltaNetSpec,
    KDASpec,
    LayerSpec,
    Mamba1Spec,
    Mamba2Spec,
    MixerSpec,
    MLASpec,
    ParamEstimate,
    ShortConvSpec,
)


def mixer_params(m: MixerSpec, hidden: int) -> int:
    """Weights of one token mixer with model width `hidden`."""
    if isinstance(m, AttentionSpec):
        q = m.num_heads * m.head_dim * (2 if m.output_gate else 1)
        return hidden * (q + 2 * m.num_kv_heads * m.head_dim) + m.num_heads * m.head_dim * hidden
    if isinstance(m, MLASpec):
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:  # q_a_proj, its norm, q_b_proj
            q = hidden * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * m.num_heads * qk
        else:
            q = hidden * m.num_heads * qk
        kv_a = hidden * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # + kv_a_layernorm
        kv_b = m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv_a + kv_b + m.num_heads * m.v_head_dim * hidden
    if isinstance(m, GatedDeltaNetSpec):
        key, value = m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim
        in_proj = hidden * (2 * key + 2 * value + 2 * m.num_v_heads)  # q, k, v, z, b, a
        per_head = 2 * m.num_v_heads + m.head_v_dim  # dt_bias, A_log, gated RMSNorm weight
        return in_proj + m.conv_dim * m.conv_kernel + per_head + value * hidden
    if isinstance(m, KDASpec):
        inner, d = m.num_heads * m.head_dim, m.head_dim
        proj = 3 * hidden * inner + inner * hidden  # q, k, v, o
        gates = 2 * (hidden * d + d * inner) + hidden * m.num_heads  # f_a/f_b, g_a/g_b low rank, b_proj
        return proj + gates + m.conv_dim * m.conv_kernel + inner + m.num_heads + d  # dt_bias, A_log, o_norm
    if isinstance(m, Mamba2Spec):
        in_proj = hidden * (2 * m.d_inner + 2 * m.n_groups * m.d_state + m.num_heads)  # z, x, B, C, dt
        conv = m.conv_dim * (m.conv_kernel + 1)  # weight + bias
        return in_proj + conv + 3 * m.num_heads + m.d_inner + m.d_inner * hidden  # dt_bias, A, D, norm
    if isinstance(m, Mamba1Spec):
        d, n, r = m.d_inner, m.d_state, m.dt_rank
        in_proj = hidden * 2 * d
        conv = d * (m.conv_kernel + 1)
        x_proj = d * (r + 2 * n)
        dt_proj = r * d + d
        return in_proj + conv + x_proj + dt_proj + d * n + d + d * hidden  # + A_log, D, out_proj
    if isinstance(m, ShortConvSpec):
        return hidden * 3 * m.dim + m.dim * m.kernel + m.dim * hidden  # in_proj (B, C, x), conv, out_proj
    raise TypeError(f"unknown mixer spec {type(m).__name__}")


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
            if isinstance(m, (AttentionSpec, MLASpec)):
                attention += mixer_params(m, hidden)
            else:
                linear += mixer_params(m, hidden)
        dense, experts = ffn_params(layer.ffn, hidden)
        mlp, moe = mlp + dense, moe + experts
        if any(isinstance(m, (AttentionSpec, MLASpec)) for m in layer.mixers):
            attention += norms
        else:
            linear += norms
    embeddings = vocab * hidden * (1 if tied else 2) + hidden  # embed, lm_head, final norm
    return ParamEstimate(attention + extra_attention, linear + extra_linear, mlp, moe + extra_moe, embeddings)
