"""Falcon-H1: every layer runs attention and Mamba-2 in parallel, then a gated MLP.

Mamba width: mamba_d_ssm (or mamba_expand x hidden) split into mamba_n_heads heads of
mamba_d_head ("auto": the quotient), as transformers' FalconH1Config computes.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import attention, attention_bias, build_plan, mlp

MODEL_TYPES = ("falcon_h1",)


def mamba_heads(cfg: ConfigView, d_inner: int) -> tuple[int, int]:
    """(heads, head_dim) with head_dim "auto" meaning d_inner / heads."""
    heads = cfg.int("mamba_n_heads")
    head_dim = cfg.raw("mamba_d_head", default="auto")
    if head_dim == "auto":
        if d_inner % heads:
            raise cfg.error("mamba_n_heads", f"{heads} does not divide the Mamba width {d_inner}")
        return heads, d_inner // heads
    head_dim = cfg.int("mamba_d_head")
    if heads * head_dim != d_inner:
        raise cfg.error("mamba_d_head", f"{heads} heads x {head_dim} != the Mamba width {d_inner}")
    return heads, head_dim


def read(cfg: ConfigView, name: str) -> ModelPlan:
    hidden = cfg.int("hidden_size")
    d_inner = cfg.int("mamba_d_ssm") if cfg.has("mamba_d_ssm") else cfg.int("mamba_expand") * hidden
    heads, head_dim = mamba_heads(cfg, d_inner)
    mamba = Mamba2Spec(heads, head_dim, cfg.int("mamba_d_state"), cfg.int("mamba_n_groups"), cfg.int("mamba_d_conv"),
                       in_proj_bias=cfg.bool("mamba_proj_bias", default=False),
                       out_proj_bias=cfg.bool("projectors_bias", default=False),
                       conv_bias=cfg.bool("mamba_conv_bias", default=True),
                       gated_norm=cfg.bool("mamba_rms_norm", default=False))  # the output norm is optional here
    bias = attention_bias(cfg)
    mixers = (attention(cfg, qkv_bias=bias, o_bias=bias), mamba)
    ffn = mlp(cfg, bias=cfg.bool("mlp_bias", default=False))
    layers = [LayerSpec(i, mixers, ffn) for i in range(cfg.int("num_hidden_layers"))]
    return build_plan(cfg, name, "falcon_h1", layers)
