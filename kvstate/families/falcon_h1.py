"""Falcon-H1: every layer runs attention and Mamba-2 in parallel, then a gated MLP.

Mamba width: mamba_d_ssm (or mamba_expand x hidden) split into mamba_n_heads heads of
mamba_d_head ("auto": the quotient), as transformers' FalconH1Config computes.

Model building: each block's two mixers run side by side (`models.decoder.ParallelMixers`,
weights under `mixer.attention.*` and `mixer.mamba2.*`) on the block's one input norm, with the
muP multipliers as transformers applies them: attention_in/out and ssm_in/out around each mixer,
key_multiplier on k, ssm_multipliers on in_proj's [z, x, B, C, dt], mlp_multipliers on the MLP's
gate and down outputs, embedding_multiplier and lm_head_multiplier. The Mamba output norm is
optional (`mamba_rms_norm`; without it y * silu(z)) and norms before gating by default.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import attention, attention_bias, build_plan, mlp
from kvstate.families._options import eps, rope
from kvstate.families._weights import Target, common_targets
from kvstate.families.mamba2 import dt_limit

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


# -- model building (kvstate.models) -------------------------------------------------------------

_RULES = ((r"layers\.(\d+)\.self_attn\.(\w+)\.(weight|bias)", r"layers.\1.mixer.attention.\2.\3"),
          (r"layers\.(\d+)\.mamba\.conv1d\.(weight|bias)", r"layers.\1.mixer.mamba2.conv_\2"),
          (r"layers\.(\d+)\.mamba\.(in_proj|out_proj|norm)\.(weight|bias)", r"layers.\1.mixer.mamba2.\2.\3"),
          (r"layers\.(\d+)\.mamba\.(dt_bias|A_log|D)", r"layers.\1.mixer.mamba2.\2"),
          (r"layers\.(\d+)\.feed_forward\.(\w+)\.(weight|bias)", r"layers.\1.ffn.\2.\3"),
          (r"layers\.(\d+)\.pre_ff_layernorm\.weight", r"layers.\1.ffn_norm.weight"),
          (r"final_layernorm\.weight", "norm.weight"))


def _multiplier(cfg: ConfigView, name: str) -> float:
    value = cfg.raw(name, default=1.0)
    if value is None:  # transformers reads null as its default
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise cfg.error(name, f"expected a number, got {value!r}")
    return float(value)


def _multipliers(cfg: ConfigView, name: str, n: int) -> tuple[float, ...]:
    value = cfg.raw(name, default=None)
    if value is None:
        return (1.0,) * n
    if not isinstance(value, (list, tuple)) or len(value) != n or \
            any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value):
        raise cfg.error(name, f"expected a list of {n} numbers, got {value!r}")
    return tuple(float(v) for v in value)


def model_options(cfg: ConfigView) -> ModelOptions:
    act = cfg.str("hidden_act", default="silu")
    m = lambda name: _multiplier(cfg, name)  # noqa: E731
    mamba = {"dt_limit": dt_limit(cfg), "act": act,
             "norm_before_gate": cfg.bool("mamba_norm_before_gate", default=True),
             "in_proj_scales": _multipliers(cfg, "ssm_multipliers", 5)}
    return ModelOptions(
        norm_eps=eps(cfg, "rms_norm_eps", default=1e-5), act=act, **rope(cfg),
        mixer={"attention": {"key_scale": m("key_multiplier")}, "mamba2": mamba},
        mixer_scales={"attention": (m("attention_in_multiplier"), m("attention_out_multiplier")),
                      "mamba2": (m("ssm_in_multiplier"), m("ssm_out_multiplier"))},
        mlp_scales=_multipliers(cfg, "mlp_multipliers", 2), embedding_scale=m("embedding_multiplier"),
        logits_scale=m("lm_head_multiplier"))


def weight_targets(name: str, plan) -> list[Target] | None:
    return common_targets(name, plan, extra_rules=_RULES)
