"""transformers' defaults for config fields, per model_type: a field a config leaves out is read
with the value transformers would fill in, so kvstate reads every config as transformers does.

The table (kvstate/data/config_defaults.json) is generated from transformers' own config classes,
not written by hand: `python -m kvstate.families.defaults_table` rewrites it (transformers installed), and
tests/test_config_defaults.py checks it still equals those classes. At run time it is plain JSON:
no torch, no transformers. Kept: the defaults of each class's own fields that are JSON scalars
(int, finite float, str, bool); None means "derived from other fields" in transformers, and the
family adapters derive those themselves.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from importlib import resources
from typing import Any

TABLE = "config_defaults.json"


@lru_cache(maxsize=1)
def _table() -> dict[str, Any]:
    return json.loads((resources.files("kvstate") / "data" / TABLE).read_text())


def defaults_for(model_type: object) -> dict[str, Any]:
    """transformers' defaults of `model_type`'s config fields ({} for an unknown type)."""
    return _table()["defaults"].get(model_type, {}) if isinstance(model_type, str) else {}


def sub_config_type(model_type: object, name: str) -> str | None:
    """The model_type of a nested config (Qwen3.5's `text_config` -> "qwen3_5_text"), or None."""
    return _table()["sub_configs"].get(model_type, {}).get(name) if isinstance(model_type, str) else None


# -- generation from transformers (a development step, not run time) ---------------------------

def _scalar(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, (bool, int, str))


def _class_defaults(cls, base_fields: set[str]) -> dict[str, Any]:
    import dataclasses

    out = {}
    for f in dataclasses.fields(cls):
        if f.name in base_fields or f.default is dataclasses.MISSING or not _scalar(f.default):
            continue
        out[f.name] = f.default
    return dict(sorted(out.items()))


def generate(model_types: list[str]) -> dict[str, Any]:
    """The table for `model_types` (and their nested configs), read from transformers' classes."""
    import dataclasses

    import transformers
    from transformers import CONFIG_MAPPING, PreTrainedConfig

    base = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    defaults: dict[str, dict[str, Any]] = {}
    subs: dict[str, dict[str, str]] = {}
    for model_type in model_types:
        if model_type not in CONFIG_MAPPING:
            continue
        cls = CONFIG_MAPPING[model_type]
        defaults[model_type] = _class_defaults(cls, base)
        for name, sub_cls in sorted((getattr(cls, "sub_configs", None) or {}).items()):
            sub_type = getattr(sub_cls, "model_type", None)
            if name == "text_config" and sub_type:  # kvstate runs text models only
                subs.setdefault(model_type, {})[name] = sub_type
                defaults[sub_type] = _class_defaults(sub_cls, base)
    return {"transformers_version": transformers.__version__, "defaults": dict(sorted(defaults.items())),
            "sub_configs": subs}
