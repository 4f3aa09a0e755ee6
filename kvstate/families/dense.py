"""Dense-attention transformers (llama, mistral, qwen2, qwen3, ...): every layer full attention.

They share the standard fields (num_attention_heads, num_key_value_heads, optional head_dim,
intermediate_size). The MoE variants among them (mixtral, qwen2_moe, qwen3_moe) route every
FFN to experts (except `mlp_only_layers` and layers off `decoder_sparse_step`). Sliding windows
are not modelled: every layer keeps the whole context.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import AttentionSpec, FfnSpec, LayerSpec, ModelPlan
from kvstate.families._common import attention, attention_bias, build_plan, mlp
from kvstate.config.options import ModelOptions
from kvstate.families._options import eps, rope
from kvstate.families._weights import Target, common_targets

DENSE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "granite")
MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
MODEL_TYPES = DENSE + MOE
_QK_NORM = ("qwen3", "qwen3_moe")  # per-head q_norm / k_norm
_ATTENTION_BIAS = ("llama", "qwen3", "gemma", "granite", "qwen3_moe")  # honour attention_bias (q, k, v, o)
_MLP_BIAS = ("llama", "granite")  # honour mlp_bias


def _moe(cfg: ConfigView, model_type: str) -> FfnSpec:
    shared = cfg.int("shared_expert_intermediate_size", default=0, minimum=0)
    return FfnSpec("moe", num_experts=cfg.int("num_local_experts", "num_experts"),
                   experts_per_token=cfg.int("num_experts_per_tok"),
                   expert_intermediate_size=cfg.int("moe_intermediate_size", "intermediate_size"),
                   shared_intermediate_size=shared, shared_expert_gate=model_type == "qwen2_moe")


def _attention(cfg: ConfigView, model_type: str) -> AttentionSpec:
    """Biases as transformers builds them: Qwen2 always on q/k/v (Qwen2-MoE: `qkv_bias`), never on o."""
    if model_type in ("qwen2", "qwen2_moe"):
        qkv = model_type == "qwen2" or cfg.bool("qkv_bias", default=True)
        return attention(cfg, qkv_bias=qkv)
    bias = model_type in _ATTENTION_BIAS and attention_bias(cfg)
    return attention(cfg, qk_norm=model_type in _QK_NORM, qkv_bias=bias, o_bias=bias)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    model_type = cfg.str("model_type")
    attn = _attention(cfg, model_type)
    n = cfg.int("num_hidden_layers")
    sparse = _moe(cfg, model_type) if model_type in MOE else None
    dense_only = set(cfg.int_list("mlp_only_layers")) if sparse and cfg.has("mlp_only_layers") else set()
    step = cfg.int("decoder_sparse_step", default=1)
    dense = mlp(cfg, bias=model_type in _MLP_BIAS and cfg.bool("mlp_bias", default=False))
    layers = [LayerSpec(i, (attn,), sparse if sparse and i not in dense_only and (i + 1) % step == 0
                        else dense) for i in range(n)]
    return build_plan(cfg, name, model_type, layers, tie_default=model_type in ("gemma",))


# -- model building (kvstate.models) -------------------------------------------------------------

_RUNNABLE = ("llama", "mistral", "qwen2", "qwen3")


def model_options(cfg: ConfigView) -> ModelOptions:
    model_type = cfg.str("model_type")
    if model_type not in _RUNNABLE:
        raise cfg.error("model_type", f"{model_type!r} can be planned but not run (runnable dense: "
                        f"{', '.join(_RUNNABLE)})")
    return ModelOptions(norm_eps=eps(cfg), act=cfg.str("hidden_act", default="silu"), **rope(cfg))


def weight_targets(name: str, plan) -> list[Target] | None:
    return common_targets(name, plan)
