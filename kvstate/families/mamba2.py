"""Mamba-2 (pure SSM, e.g. Mamba-Codestral): every layer a Mamba-2 mixer, no FFN, no KV cache."""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import FFN_NONE, LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import build_plan

MODEL_TYPES = ("mamba2",)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    spec = Mamba2Spec(
        num_heads=cfg.int("num_heads"),
        head_dim=cfg.int("head_dim"),
        d_state=cfg.int("state_size"),
        n_groups=cfg.int("n_groups"),
        conv_kernel=cfg.int("conv_kernel"),
    )
    if cfg.has("expand") and cfg.int("expand") * cfg.int("hidden_size") != spec.d_inner:
        raise cfg.error(("num_heads", "head_dim"), f"num_heads x head_dim = {spec.d_inner} but expand x "
                        f"hidden_size = {cfg.int('expand') * cfg.int('hidden_size')}")
    layers = [LayerSpec(i, (spec,), FFN_NONE) for i in range(cfg.int("num_hidden_layers"))]
    return build_plan(cfg, name, "mamba2", layers)
