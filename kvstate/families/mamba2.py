"""Mamba-2 (pure SSM, e.g. Mamba-Codestral): every layer a Mamba-2 mixer, no FFN, no KV cache.

Checkpoint names are Mamba's own (backbone.embeddings, backbone.layers.N.norm / .mixer.*,
backbone.norm_f); `layer_targets` maps them and is shared with Nemotron-H, which uses the same
layout. The chunked scan clamps dt to `time_step_limit`.
"""

from __future__ import annotations

import math
import re

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import FFN_NONE, LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import build_plan
from kvstate.families._options import eps
from kvstate.families._weights import Target, strip_prefix

MODEL_TYPES = ("mamba2",)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    spec = Mamba2Spec(
        num_heads=cfg.int("num_heads"),
        head_dim=cfg.int("head_dim"),
        d_state=cfg.int("state_size"),
        n_groups=cfg.int("n_groups"),
        conv_kernel=cfg.int("conv_kernel"),
        **mamba2_biases(cfg),
    )
    if cfg.has("expand") and cfg.int("expand") * cfg.int("hidden_size") != spec.d_inner:
        raise cfg.error(("num_heads", "head_dim"), f"num_heads x head_dim = {spec.d_inner} but expand x "
                        f"hidden_size = {cfg.int('expand') * cfg.int('hidden_size')}")
    layers = [LayerSpec(i, (spec,), FFN_NONE) for i in range(cfg.int("num_hidden_layers"))]
    return build_plan(cfg, name, "mamba2", layers)


def mamba2_biases(cfg: ConfigView) -> dict[str, bool]:
    """Mamba2Spec's bias flags as Mamba2 / Nemotron-H configs spell them: use_bias (in_proj and
    out_proj), use_conv_bias (the conv)."""
    bias = cfg.bool("use_bias", default=False)
    return {"in_proj_bias": bias, "out_proj_bias": bias,
            "conv_bias": cfg.bool("use_conv_bias", "mamba_conv_bias", default=True)}


# -- model building (kvstate.models) -------------------------------------------------------------

_PREFIXES = ("backbone.", "model.")
_TOP = {"embeddings.weight": "embed_tokens.weight", "embedding.weight": "embed_tokens.weight",  # older exports
        "norm_f.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
_MAMBA = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias"}  # the rest keep their names
_LAYER = re.compile(r"layers\.(\d+)\.(norm|mixer)\.(.+)")


def config_float(cfg: ConfigView, name: str, value) -> float:
    """A float that JSON may spell as a number, "inf"/"Infinity" or {"__float__": "Infinity"}."""
    if isinstance(value, dict) and set(value) == {"__float__"}:  # transformers' encoding of non-finite floats
        value = value["__float__"]
    if isinstance(value, bool):
        raise cfg.error(name, f"expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise cfg.error(name, f"expected a number, got {value!r}") from None


def dt_limit(cfg: ConfigView) -> tuple[float, float]:
    """`time_step_limit` [min, max] (default: no limit)."""
    raw = cfg.raw("time_step_limit", default=None)
    if raw is None:
        return (0.0, math.inf)
    if not isinstance(raw, (list, tuple)) or len(raw) != 2:
        raise cfg.error("time_step_limit", f"expected [min, max], got {raw!r}")
    return (config_float(cfg, "time_step_limit", raw[0]), config_float(cfg, "time_step_limit", raw[1]))


def mamba_options(cfg: ConfigView, *, limit: tuple[float, float], act: tuple[str, ...]) -> dict:
    """The Mamba2 layer's keyword arguments beyond the spec: dt clamp of the chunked scan, conv activation."""
    return {"dt_limit": limit, "act": cfg.str(*act, default="silu")}


def model_options(cfg: ConfigView) -> ModelOptions:
    return ModelOptions(norm_eps=eps(cfg, "layer_norm_epsilon", default=1e-5), rope_theta=None,
                        mixer={"mamba2": mamba_options(cfg, limit=dt_limit(cfg), act=("hidden_act",))})


def layer_targets(name: str, plan, *, prefixes=_PREFIXES, ffn_rules=None) -> list[Target] | None:
    """Mamba-style names: [backbone.]embeddings / norm_f / layers.N.norm / layers.N.mixer.*.

    Block N's one `norm` is the input norm of its mixer, or the FFN norm of a mixer-less block
    (Nemotron-H's MLP and MoE blocks, whose `mixer.*` are then FFN weights: `ffn_rules(i, rest)`)."""
    short = strip_prefix(name, prefixes)
    if short in _TOP:
        return [Target(_TOP[short])]
    m = _LAYER.fullmatch(short)
    if not m or int(m[1]) >= plan.num_layers:
        return None
    i, part, rest = int(m[1]), m[2], m[3]
    layer = plan.layers[i]
    if part == "norm":
        return [Target(f"layers.{i}.{'input_norm' if layer.mixers else 'ffn_norm'}.{rest}")]
    if layer.mixers:
        return [Target(f"layers.{i}.mixer.{_MAMBA.get(rest, rest)}")]
    return ffn_rules(i, rest) if ffn_rules else None


def weight_targets(name: str, plan) -> list[Target] | None:
    return layer_targets(name, plan)
