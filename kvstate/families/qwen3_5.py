"""Qwen3.5 (dense and MoE): Gated DeltaNet layers with a gated full-attention layer every few.

model_types: `qwen3_5` / `qwen3_5_moe` (multimodal checkpoints; the text model is nested under
`text_config`, whose own model_type is `qwen3_5_text` / `qwen3_5_moe_text`) and the text-only
configs themselves. `dtype` and `mamba_ssm_dtype` may sit only inside `text_config`;
`tie_word_embeddings` is read from the outer config when it is there.
"""

from __future__ import annotations

import re
from dataclasses import replace
from types import SimpleNamespace

from kvstate.config.fields import ConfigView
from kvstate.config.plan import AttentionSpec, FfnSpec, GatedDeltaNetSpec, LayerSpec, ModelPlan
from kvstate.families._common import attention, attention_bias, build_plan, layer_words, mlp
from kvstate.config.options import ModelOptions
from kvstate.families._options import eps, rope
from kvstate.families._weights import Target, common_targets

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_NESTED = ("qwen3_5", "qwen3_5_moe")


def text_view(cfg: ConfigView, model_type: str) -> ConfigView:
    """The text model's fields, with the outer dtype / tie_word_embeddings folded in."""
    if model_type not in _NESTED:
        return cfg
    text = cfg.sub("text_config")
    merged = {k: cfg.data[k] for k in ("dtype", "torch_dtype") if cfg.data.get(k) is not None}
    merged.update(text.data)
    if cfg.data.get("tie_word_embeddings") is not None:
        merged["tie_word_embeddings"] = cfg.data["tie_word_embeddings"]
    return ConfigView(merged, cfg.source, text.prefix, text.defaults)


def gated_deltanet(cfg: ConfigView) -> GatedDeltaNetSpec:
    return GatedDeltaNetSpec(
        num_k_heads=cfg.int("linear_num_key_heads"),
        num_v_heads=cfg.int("linear_num_value_heads"),
        head_k_dim=cfg.int("linear_key_head_dim"),
        head_v_dim=cfg.int("linear_value_head_dim"),
        conv_kernel=cfg.int("linear_conv_kernel_dim"),
    )


def full_or_linear(cfg: ConfigView) -> list[str]:
    """`layer_types`, or full attention where (i + 1) % full_attention_interval == 0."""
    if cfg.has("layer_types"):
        return layer_words(cfg, ("layer_types",), {"full", "linear"})
    if not cfg.has("full_attention_interval"):
        raise cfg.error(("layer_types", "full_attention_interval"), "missing (one of them is needed)")
    interval, n = cfg.int("full_attention_interval"), cfg.int("num_hidden_layers")
    return ["full" if (i + 1) % interval == 0 else "linear" for i in range(n)]


def qwen_moe(cfg: ConfigView) -> FfnSpec:
    """Routed experts plus one sigmoid-gated shared expert (its gate is a hidden x 1 linear)."""
    return FfnSpec("moe", num_experts=cfg.int("num_experts"), experts_per_token=cfg.int("num_experts_per_tok"),
                   expert_intermediate_size=cfg.int("moe_intermediate_size"),
                   shared_intermediate_size=cfg.int("shared_expert_intermediate_size", minimum=0),
                   shared_expert_gate=True)


def qwen_attention(cfg: ConfigView) -> AttentionSpec:
    """Gated attention (Qwen always gates) with per-head q/k norms; attention_bias on q, k, v and o."""
    bias = attention_bias(cfg)
    return attention(cfg, output_gate=cfg.bool("attn_output_gate", default=True), qk_norm=True,
                     qkv_bias=bias, o_bias=bias)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    model_type = cfg.str("model_type")
    t = text_view(cfg, model_type)
    words = full_or_linear(t)
    attn = qwen_attention(t)
    gdn = gated_deltanet(t)
    ffn = qwen_moe(t) if "moe" in model_type else mlp(t)
    layers = [LayerSpec(i, (attn if w == "full" else gdn,), ffn) for i, w in enumerate(words)]
    return with_mtp(build_plan(t, name, model_type, layers), t, attn, ffn)


def with_mtp(plan: ModelPlan, cfg: ConfigView, attn: AttentionSpec, ffn: FfnSpec) -> ModelPlan:
    """`plan` with its multi-token-prediction blocks (`mtp_num_hidden_layers`, 0 when absent): full
    attention with the model's attention and its MoE (or MLP), indexed after the decoder's blocks."""
    n = cfg.int("mtp_num_hidden_layers", default=0, minimum=0)
    mtp = tuple(LayerSpec(plan.num_layers + i, (attn,), ffn) for i in range(n))
    return replace(plan, mtp=mtp) if mtp else plan


# -- model building (kvstate.models) -------------------------------------------------------------

_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.")
_SKIP = (r"model\.visual\.", r"visual\.")
_MTP = re.compile(r"mtp\.(fc|norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight")
_RULES = ((r"layers\.(\d+)\.linear_attn\.conv1d\.weight", r"layers.\1.mixer.conv_weight"),
          (r"layers\.(\d+)\.linear_attn\.(\w+)\.weight", r"layers.\1.mixer.\2.weight"),
          (r"layers\.(\d+)\.linear_attn\.(A_log|dt_bias)", r"layers.\1.mixer.\2"))


def model_options(cfg: ConfigView) -> ModelOptions:
    """Zero-centred RMSNorm (1 + w), q/k norm, partial rotary, softmax routing with a gated shared expert."""
    return ModelOptions(norm_eps=eps(cfg), norm_offset=1.0, act=cfg.str("hidden_act", default="silu"),
                        router={"kind": "softmax", "norm_topk": cfg.bool("norm_topk_prob", default=True)},
                        shared_expert_gate=True, **rope(cfg))


def weight_targets(name: str, plan) -> list[Target] | None:
    if name.startswith("mtp."):
        return mtp_targets(name, plan)
    return common_targets(name, plan, prefixes=_PREFIXES, extra_rules=_RULES, skip=_SKIP)


def mtp_targets(name: str, plan) -> list[Target] | None:
    """mtp.fc / mtp.*norm / mtp.layers.{i}.* (a decoder block's names) -> our `mtp.*`; skipped ([])
    when the config has no MTP blocks (the model is built without them)."""
    if not plan.mtp:
        return []
    if _MTP.fullmatch(name):
        return [Target(name)]
    inner = common_targets(name[len("mtp."):], SimpleNamespace(layers=plan.mtp), prefixes=())
    return None if inner is None else [Target("mtp." + t.name, t.index, t.rows) for t in inner]
