"""Family adapters: one small torch-free module per HF model_type family, and `read_plan`.

Each module lists its `MODEL_TYPES` and has `read(cfg: ConfigView, name: str) -> ModelPlan`,
which translates the config into the normalized layer plan (kvstate.config.plan), and maps the
family's HF weight names to kvstate's. `read_plan(source)` reads a config (kvstate.config.reader)
and dispatches on its `model_type`:

    from kvstate.families import read_plan
    plan = read_plan("qwen3.5-0.8b")      # or a config.json path, a checkpoint dir, a dict
    plan.layer_string                      # 'GGGAGGGA...'
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Mapping

from kvstate.config.fields import ConfigView
from kvstate.config.plan import ModelPlan
from kvstate.config.reader import read_config

_MODULES = ("qwen3_5", "qwen3_next", "kimi_linear", "jamba", "nemotron_h", "mamba2", "falcon_h1", "lfm2",
            "granitemoehybrid", "dense")


def _registry() -> dict[str, ModuleType]:
    table: dict[str, ModuleType] = {}
    for name in _MODULES:
        module = importlib.import_module(f"kvstate.families.{name}")
        for model_type in module.MODEL_TYPES:
            table[model_type] = module
    return table


def adapter(model_type: str) -> ModuleType | None:
    """The family module for an HF model_type, or None if unsupported."""
    return _registry().get(model_type)


def supported_model_types() -> list[str]:
    return sorted(_registry())


def read_plan(source: str | os.PathLike | Mapping[str, Any], *, name: str | None = None) -> ModelPlan:
    """The normalized layer plan of a config (see kvstate.config.plan).

    `source` is a config.json path, a checkpoint directory, a bundled short name or an
    already-loaded dict; `name` overrides the display name."""
    data, label, display = read_config(source, name)
    cfg = ConfigView(data, label)
    model_type = cfg.str("model_type")
    family = adapter(model_type)
    if family is None:
        raise cfg.error("model_type", f"unsupported model_type {model_type!r}; supported: "
                        f"{', '.join(supported_model_types())}")
    return family.read(cfg, display)
