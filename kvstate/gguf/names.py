"""GGUF tensor names -> the checkpoint's names, per architecture (llama.cpp's gguf-py tensor_mapping.py read
backwards: each converter writes its family's HF names under the same `blk.{i}.*` names). Torch-free."""

from __future__ import annotations

import re

_QKV = {f"attn_{x}.weight": f"self_attn.{x}_proj.weight" for x in "qkv"}  # every family's but Nemotron-H's
# blk.{i}.<gguf name> -> model.layers.{i}.<HF name>
_LAYER = {
    **_QKV, "attn_output.weight": "self_attn.o_proj.weight",
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",  # qwen3next: still fused, as in its checkpoint
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# the experts, merged into one [experts, out, in] tensor each: -> mlp.experts.{e}.<name>
_EXPERTS = {"ffn_gate_exps.weight": "gate_proj.weight", "ffn_up_exps.weight": "up_proj.weight",
            "ffn_down_exps.weight": "down_proj.weight"}
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
           "output_norm.weight": "model.norm.weight"}
# Mamba-2 (conversion/mamba.py): the checkpoint's backbone.* names
_MAMBA2_LAYER = {
    "attn_norm.weight": "norm.weight", "ssm_a": "mixer.A_log", "ssm_d": "mixer.D", "ssm_dt.bias": "mixer.dt_bias",
    "ssm_conv1d.weight": "mixer.conv1d.weight", "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_in.weight": "mixer.in_proj.weight", "ssm_in.bias": "mixer.in_proj.bias",
    "ssm_norm.weight": "mixer.norm.weight",
    "ssm_out.weight": "mixer.out_proj.weight", "ssm_out.bias": "mixer.out_proj.bias",
}
_MAMBA2_GLOBAL = {"token_embd.weight": "backbone.embeddings.weight", "output.weight": "lm_head.weight",
                  "output_norm.weight": "backbone.norm_f.weight"}
_WB = ("weight", "bias")
# Nemotron-H (conversion/nemotron.py): Mamba-2 blocks as above, attention and relu2 MLP blocks under `mixer`
_NEMOTRON_H_LAYER = {**_MAMBA2_LAYER, **{f"{g}.{kind}": f"mixer.{h}.{kind}" for g, h in (
    ("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"),
    ("ffn_up", "up_proj"), ("ffn_down", "down_proj")) for kind in _WB},
    # MoE blocks: router and its correction bias, shared expert, latent projections (experts: `_EXPERTS`)
    "ffn_gate_inp.weight": "mixer.gate.weight", "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
    "ffn_latent_down.weight": "mixer.fc1_latent_proj.weight", "ffn_latent_up.weight": "mixer.fc2_latent_proj.weight"}
# LFM2 (conversion/lfm2.py): the conv weight squeezed to [hidden, L]; its final norm is `embedding_norm`
_LFM2_LAYER = {
    **_QKV, "attn_output.weight": "self_attn.out_proj.weight",
    "attn_norm.weight": "operator_norm.weight", "ffn_norm.weight": "ffn_norm.weight",
    "attn_q_norm.weight": "self_attn.q_layernorm.weight", "attn_k_norm.weight": "self_attn.k_layernorm.weight",
    "ffn_gate.weight": "feed_forward.w1.weight", "ffn_up.weight": "feed_forward.w3.weight",
    "ffn_down.weight": "feed_forward.w2.weight",
    **{f"shortconv.{p}.{kind}": f"conv.{h}.{kind}" for p, h in (("conv", "conv"), ("in_proj", "in_proj"),
                                                                 ("out_proj", "out_proj")) for kind in _WB},
}
_LFM2_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "token_embd_norm.weight": "model.embedding_norm.weight"}
# Falcon-H1 (conversion/falcon_h1.py): Mamba-2 as conversion/mamba.py writes it, attention and MLP side by
# side; its converter names the MLP norm `ffn_norm` without `.weight`
_FALCON_H1_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm": "pre_ff_layernorm.weight",
    "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ssm_dt.bias": "mamba.dt_bias", "ssm_norm.weight": "mamba.norm.weight",
    **{f"{g}.{kind}": f"{h}.{kind}" for g, h in (
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
        ("attn_output", "self_attn.o_proj"), ("ssm_in", "mamba.in_proj"), ("ssm_out", "mamba.out_proj"),
        ("ssm_conv1d", "mamba.conv1d"), ("ffn_gate", "feed_forward.gate_proj"), ("ffn_up", "feed_forward.up_proj"),
        ("ffn_down", "feed_forward.down_proj")) for kind in _WB},
}
_FALCON_H1_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                     "output_norm.weight": "model.final_layernorm.weight"}
# Jamba (conversion/jamba.py): Mamba-1 with its dt/B/C norms; A = -exp(A_log) kept [inner, state]
_JAMBA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ssm_a": "mamba.A_log", "ssm_d": "mamba.D", "ffn_gate_inp.weight": "feed_forward.router.weight", **_QKV,
    **{f"{g}.weight": f"{h}.weight" for g, h in (
        ("attn_output", "self_attn.o_proj"), ("ssm_x", "mamba.x_proj"), ("ssm_dt_norm", "mamba.dt_layernorm"),
        ("ssm_b_norm", "mamba.b_layernorm"), ("ssm_c_norm", "mamba.c_layernorm"),
        ("ffn_gate", "feed_forward.gate_proj"), ("ffn_up", "feed_forward.up_proj"),
        ("ffn_down", "feed_forward.down_proj"))},
    **{f"{g}.{kind}": f"{h}.{kind}" for g, h in (
        ("ssm_in", "mamba.in_proj"), ("ssm_out", "mamba.out_proj"), ("ssm_conv1d", "mamba.conv1d"),
        ("ssm_dt", "mamba.dt_proj")) for kind in _WB},
}
_JAMBA_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                 "output_norm.weight": "model.final_layernorm.weight"}
# Kimi Linear (conversion/kimi_linear.py): KDA and MLA under `self_attn`; MLA's kv_b_proj split into k_b
# (transposed) and v_b, named here as the converter does in between (`weights` joins them back)
_KIMI_LAYER = {
    **_QKV, "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "ssm_a": "self_attn.A_log", "ssm_dt.bias": "self_attn.dt_bias", "ssm_norm.weight": "self_attn.o_norm.weight",
    **{f"ssm_{g}.weight": f"self_attn.{h}.weight" for g, h in (
        ("conv1d_q", "q_conv1d"), ("conv1d_k", "k_conv1d"), ("conv1d_v", "v_conv1d"), ("f_a", "f_a_proj"),
        ("f_b", "f_b_proj"), ("g_a", "g_a_proj"), ("g_b", "g_b_proj"), ("beta", "b_proj"))},
    **{f"attn_{g}.{kind}": f"self_attn.{h}.{kind}" for g, h in (
        ("q_a", "q_a_proj"), ("q_b", "q_b_proj"), ("kv_a_mqa", "kv_a_proj_with_mqa"), ("k_b", "k_b_proj"),
        ("v_b", "v_b_proj")) for kind in _WB},
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{g}{part}.weight": f"mlp.{h}{g}_proj.weight" for g in ("gate", "up", "down")
       for part, h in (("", ""), ("_shexp", "shared_experts."))},
}
# architecture -> (global names, per-layer names, layer prefix, where a layer keeps its experts)
_NAMES = {"lfm2": (_LFM2_GLOBAL, _LFM2_LAYER, "model.layers", None),
          "falcon-h1": (_FALCON_H1_GLOBAL, _FALCON_H1_LAYER, "model.layers", None),
          "jamba": (_JAMBA_GLOBAL, _JAMBA_LAYER, "model.layers", "feed_forward.experts"),
          "kimi-linear": (_GLOBAL, _KIMI_LAYER, "model.layers", "mlp.experts"),
          "mamba2": (_MAMBA2_GLOBAL, _MAMBA2_LAYER, "backbone.layers", None),
          "nemotron_h": (_MAMBA2_GLOBAL, _NEMOTRON_H_LAYER, "backbone.layers", "mixer.experts"),
          "nemotron_h_moe": (_MAMBA2_GLOBAL, _NEMOTRON_H_LAYER, "backbone.layers", "mixer.experts")}
# the architectures whose converter writes Mamba-2 as conversion/mamba.py does (A, D as [heads, 1], the
# gated norm [groups, inner / groups]) and permutes no q/k rows for a Qwen-style layout
MAMBA_ARCHS = ("mamba2", "nemotron_h", "nemotron_h_moe", "falcon-h1")
_QWEN = (_GLOBAL, _LAYER, "model.layers", "mlp.experts")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def hf_name(name: str, arch: str = "qwen35") -> str | None:
    """The checkpoint name of a GGUF tensor name, or None for a name this architecture does not have."""
    glob, layer, prefix, experts = _NAMES.get(arch, _QWEN)
    if name in glob:
        return glob[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in layer:
        return f"{prefix}.{m.group(1)}.{layer[m.group(2)]}"
    if m and experts and m.group(2) in _EXPERTS:  # a pattern: one name per expert ({e})
        return f"{prefix}.{m.group(1)}.{experts}.{{e}}.{_EXPERTS[m.group(2)]}"
    return None
