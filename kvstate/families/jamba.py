"""Jamba: Mamba-1 layers with an attention layer every `attn_layer_period`, MoE every other layer.

Attention iff i % attn_layer_period == attn_layer_offset; MoE iff
i % expert_layer_period == expert_layer_offset (experts of width intermediate_size), else a
dense MLP. No head_dim field: hidden_size / num_attention_heads. d_inner = mamba_expand x hidden.
"""

from __future__ import annotations

import math

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import LayerSpec, Mamba1Spec, ModelPlan
from kvstate.families._common import attention, build_plan, mlp, moe
from kvstate.families._options import eps
from kvstate.families._weights import Target, common_targets

MODEL_TYPES = ("jamba",)


def _period(cfg: ConfigView, period_key: str, offset_key: str) -> tuple[int, int]:
    period, offset = cfg.int(period_key), cfg.int(offset_key, minimum=0)
    if offset >= period:
        raise cfg.error(offset_key, f"{offset} must be smaller than {period_key} {period}")
    return period, offset


def read(cfg: ConfigView, name: str) -> ModelPlan:
    n, hidden = cfg.int("num_hidden_layers"), cfg.int("hidden_size")
    attn_period, attn_offset = _period(cfg, "attn_layer_period", "attn_layer_offset")
    exp_period, exp_offset = _period(cfg, "expert_layer_period", "expert_layer_offset")
    dt_rank = cfg.raw("mamba_dt_rank", default="auto")
    d_state = cfg.int("mamba_d_state")
    mamba = Mamba1Spec(
        d_inner=cfg.int("mamba_expand") * hidden,
        d_state=d_state,
        conv_kernel=cfg.int("mamba_d_conv"),
        dt_rank=math.ceil(hidden / 16) if dt_rank == "auto" else cfg.int("mamba_dt_rank"),
        conv_bias=cfg.bool("mamba_conv_bias", default=True),
        proj_bias=cfg.bool("mamba_proj_bias", default=False),
        inner_norms=True,  # dt/B/C RMSNorms inside each Jamba Mamba mixer
    )
    attn = attention(cfg)
    dense = mlp(cfg)
    sparse = moe(cfg, ("num_experts", "num_local_experts"), ("num_experts_per_tok",), ("intermediate_size",))
    layers = [
        LayerSpec(i, (attn if i % attn_period == attn_offset else mamba,),
                  sparse if i % exp_period == exp_offset and sparse.num_experts > 1 else dense)
        for i in range(n)
    ]
    return build_plan(cfg, name, "jamba", layers)


# -- model building (kvstate.models) -------------------------------------------------------------

_RULES = (
    (r"final_layernorm\.weight", "norm.weight"),
    (r"layers\.(\d+)\.pre_ff_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
    (r"layers\.(\d+)\.mamba\.conv1d\.(weight|bias)", r"layers.\1.mixer.conv_\2"),
    (r"layers\.(\d+)\.mamba\.(A_log|D)", r"layers.\1.mixer.\2"),
    (r"layers\.(\d+)\.mamba\.(\w+)\.(weight|bias)", r"layers.\1.mixer.\2.\3"),
    (r"layers\.(\d+)\.feed_forward\.(gate_proj|up_proj|down_proj)\.weight", r"layers.\1.ffn.\2.weight"),
    (r"layers\.(\d+)\.feed_forward\.router\.weight", r"layers.\1.ffn.gate.weight"),
    (r"layers\.(\d+)\.feed_forward\.experts\.gate_up_proj", r"layers.\1.ffn.experts.gate_up"),
    (r"layers\.(\d+)\.feed_forward\.experts\.down_proj", r"layers.\1.ffn.experts.down"),
)


def model_options(cfg: ConfigView) -> ModelOptions:
    """Plain RMSNorm, attention without positions, softmax top-k routing without renormalization."""
    act = cfg.str("hidden_act", default="silu")
    if act not in ("silu", "swish"):  # it is also the activation of the Mamba conv, which runs SiLU only
        raise cfg.error("hidden_act", f"{act!r} is not supported for Jamba (the Mamba conv runs silu)")
    mamba = {"conv_bias": cfg.bool("mamba_conv_bias", default=True),
             "proj_bias": cfg.bool("mamba_proj_bias", default=False), "act": act}
    return ModelOptions(norm_eps=eps(cfg), act=act, rope_theta=None,
                        router={"kind": "softmax", "norm_topk": False}, mixer={"mamba1": mamba})


def weight_targets(name: str, plan) -> list[Target] | None:
    """HF names (model.layers.{i}.mamba.*, .feed_forward.*, per-expert or fused experts) -> ours."""
    return common_targets(name, plan, extra_rules=_RULES)
