"""Config reading and the normalized layer plan (torch-free).

    from kvstate.config import load_config
    load_config("qwen3.5-0.8b")            # the bundled config.json as a dict
    # kvstate.families.read_plan(...) turns a config into a ModelPlan (the families sit above this package)

Modules: `plan` (dataclasses), `reader` (files, bundled names, the config and its labels),
`fields` (typed reads with file+field errors), `params` (parameter estimate), `dtypes`.
"""

from kvstate.config.dtypes import canonical_dtype, dtype_bytes, known_dtypes
from kvstate.config.plan import (
    KV_KINDS,
    LETTERS,
    AttentionSpec,
    FfnSpec,
    GatedDeltaNetSpec,
    KDASpec,
    LayerSpec,
    Mamba1Spec,
    Mamba2Spec,
    MixerSpec,
    MLASpec,
    ModelPlan,
    ParamEstimate,
    ShortConvSpec,
)
from kvstate.config.reader import BUNDLED, bundled_names, bundled_path, load_config, read_config, resolve

__all__ = [
    "AttentionSpec", "BUNDLED", "FfnSpec", "GatedDeltaNetSpec", "KDASpec", "KV_KINDS", "LETTERS", "LayerSpec",
    "MLASpec", "Mamba1Spec", "Mamba2Spec", "MixerSpec", "ModelPlan", "ParamEstimate", "ShortConvSpec",
    "bundled_names", "bundled_path", "canonical_dtype", "dtype_bytes", "known_dtypes", "load_config",
    "read_config", "resolve",
]
