"""Shared readers for the model-building options of the families (no torch)."""

from __future__ import annotations

from typing import Any

from kvstate.config.fields import ConfigView


def rope(cfg: ConfigView, default_theta: float = 10000.0) -> dict[str, Any]:
    """rope_theta, partial_rotary_factor and rope_scaling from either config generation.

    transformers 5 writes `rope_parameters` {rope_type, rope_theta, partial_rotary_factor, ...};
    older exports have top-level `rope_theta`, `partial_rotary_factor` and `rope_scaling`.
    """
    params = cfg.data.get("rope_parameters") or {}
    scaling = cfg.data.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.data.get("rope_theta", default_theta))
    partial = params.get("partial_rotary_factor", cfg.data.get("partial_rotary_factor", 1.0))
    kind = params.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
    if kind and kind not in ("default", "mrope"):
        scaling = {**(scaling or {}), **params, "rope_type": kind}
    else:
        scaling = None
    return {"rope_theta": float(theta), "partial_rotary_factor": float(partial), "rope_scaling": scaling}


def eps(cfg: ConfigView, *names: str, default: float = 1e-6) -> float:
    return float(cfg.raw(*(names or ("rms_norm_eps",)), default=default))
