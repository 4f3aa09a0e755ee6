"""Family adapters: one small torch-free module per HF model_type family.

Each module lists its `MODEL_TYPES` and has `read(cfg: ConfigView, name: str) -> ModelPlan`,
which translates the config into the normalized layer plan (kvstate.config.plan). A later
issue adds each family's weight-name mapping to the same module.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
