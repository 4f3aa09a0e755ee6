"""Config reading and the normalized layer plan (torch-free).

    from kvstate.config import read_plan
    plan = read_plan("qwen3.5-0.8b")      # or a config.json path, a checkpoint dir, a dict
    plan.layer_string                      # 'GGGAGGGA...'
    plan.layers[3].mixers[0]               # AttentionSpec(num_heads=8, num_kv_heads=2, head_dim=256, ...)

Modules: `plan` (dataclasses), `reader` (files, bundled names, dispatch to kvstate.families),
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
from kvstate.config.reader import BUNDLED, bundled_names, bundled_path, load_config, read_plan, resolve

__all__ = [
    "AttentionSpec", "BUNDLED", "FfnSpec", "GatedDeltaNetSpec", "KDASpec", "KV_KINDS", "LETTERS", "LayerSpec",
    "MLASpec", "Mamba1Spec", "Mamba2Spec", "MixerSpec", "ModelPlan", "ParamEstimate", "ShortConvSpec",
    "bundled_names", "bundled_path", "canonical_dtype", "dtype_bytes", "known_dtypes", "load_config",
    "read_plan", "resolve",
]
