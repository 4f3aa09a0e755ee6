"""Parameter counts come from the spec kinds alone: every weight fact is a field that is counted.

Each flag of a mixer kind or an FFN (q/k norms, biases, gated norms, a shared-expert gate, ...)
must change that kind's own count by exactly the weights it stands for; the plan builder takes
no per-family corrections; and configs that switch those flags on or off are counted exactly
as transformers builds them on the meta device.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from kvstate.families import read_plan
from kvstate.config.fields import ConfigView
from kvstate.config.params import estimate_params
from kvstate.config.plan import (
    MIXER_KINDS,
    AttentionSpec,
    FfnSpec,
    LayerSpec,
    Mamba1Spec,
    Mamba2Spec,
    MLASpec,
    ShortConvSpec,
)
from kvstate.families._common import build_plan

HIDDEN = 64

# one small instance of every mixer kind (dims only; flags at their defaults)
SAMPLES = {
    "attention": AttentionSpec(4, 2, 16),
    "mla": MLASpec(4, 32, 16, 8, 16, q_lora_rank=24),
    "mamba2": Mamba2Spec(4, 16, 8, 2, 4),
    "mamba1": Mamba1Spec(128, 8, 4, 4),
    "short_conv": ShortConvSpec(HIDDEN, 3),
}

# (spec, flag, the weights that flag adds when set; negative where the default is on)
FLAG_WEIGHTS = [
    (SAMPLES["attention"], "qk_norm", 2 * 16),  # q_norm, k_norm: one head_dim each
    (SAMPLES["attention"], "qkv_bias", (4 + 2 * 2) * 16),
    (SAMPLES["attention"], "o_bias", HIDDEN),
    (AttentionSpec(4, 2, 16, output_gate=True), "qkv_bias", (2 * 4 + 2 * 2) * 16),  # the gate half too
    (SAMPLES["mla"], "bias", 24 + 32 + 8 + HIDDEN),  # q_a_proj, kv_a_proj_with_mqa, o_proj
    (MLASpec(4, 32, 16, 8, 16), "bias", 32 + 8 + HIDDEN),  # no q_a_proj without q_lora_rank
    (SAMPLES["mamba2"], "in_proj_bias", 64 + (64 + 2 * 2 * 8) + 4),  # z, x B C, dt
    (SAMPLES["mamba2"], "out_proj_bias", HIDDEN),
    (SAMPLES["mamba2"], "conv_bias", -(64 + 2 * 2 * 8)),
    (SAMPLES["mamba2"], "gated_norm", -64),
    (SAMPLES["mamba1"], "conv_bias", -128),
    (SAMPLES["mamba1"], "proj_bias", 2 * 128 + HIDDEN),
    (SAMPLES["mamba1"], "inner_norms", -(4 + 2 * 8)),  # dt, B and C RMSNorms
    (SAMPLES["short_conv"], "bias", 3 * HIDDEN + HIDDEN + HIDDEN),  # in_proj, conv, out_proj
]


def _flags(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.type in ("bool", bool)]


@pytest.mark.parametrize("spec,flag,weights", FLAG_WEIGHTS, ids=lambda v: v if isinstance(v, str) else None)
def test_each_flag_is_counted_by_its_kind(spec, flag, weights):
    on = dataclasses.replace(spec, **{flag: True})
    off = dataclasses.replace(spec, **{flag: False})
    assert on.params(HIDDEN) - off.params(HIDDEN) == abs(weights)
    assert getattr(spec, flag) is (weights < 0)  # the default: on where the count above is negative
    # the flag is a weight fact only: the cache entry stays the same
    assert (on.kv_shape(), on.state_shape(), on.conv_shape()) == (off.kv_shape(), off.state_shape(), off.conv_shape())


def test_every_bool_field_of_every_kind_is_in_the_table():
    """A new flag on a spec kind needs a row above, so an uncounted flag cannot slip in."""
    listed = {(type(spec).__name__, flag) for spec, flag, _ in FLAG_WEIGHTS}
    declared = {(cls.__name__, flag) for cls in MIXER_KINDS for flag in _flags(cls) if flag != "output_gate"}
    assert declared <= listed


@pytest.mark.parametrize("ffn,flag,weights", [
    (FfnSpec("moe", num_experts=4, experts_per_token=2, expert_intermediate_size=32, shared_intermediate_size=48),
     "shared_expert_gate", HIDDEN),  # a hidden -> 1 linear
    (FfnSpec("mlp", intermediate_size=96), "bias", 2 * 96 + HIDDEN),  # gate, up (width), down (hidden)
    (FfnSpec("mlp", intermediate_size=96, gated=False), "bias", 96 + HIDDEN),
    (FfnSpec("moe", gated=False, num_experts=4, experts_per_token=2, expert_intermediate_size=32,
             shared_intermediate_size=48, latent_size=16), "bias", (48 + HIDDEN) + (16 + HIDDEN)),  # shared, latent
])
def test_ffn_flags_are_counted(ffn, flag, weights):
    on, off = dataclasses.replace(ffn, **{flag: True}), dataclasses.replace(ffn, **{flag: False})
    assert sum(on.params(HIDDEN)) - sum(off.params(HIDDEN)) == weights
    assert set(_flags(FfnSpec)) == {"gated", "shared_expert_gate", "bias"}  # a new flag needs a case here


def test_build_plan_takes_no_per_family_corrections():
    for fn in (build_plan, estimate_params):
        assert not [p for p in inspect.signature(fn).parameters if p.startswith("extra")]
    cfg = ConfigView({"hidden_size": HIDDEN, "vocab_size": 100}, "test")
    layers = [LayerSpec(0, (SAMPLES["attention"],), FfnSpec("mlp", intermediate_size=96))]
    assert build_plan(cfg, "t", "llama", layers).params.total > 0
    for extra in ("extra_attention", "extra_linear", "extra_moe"):
        with pytest.raises(TypeError):
            build_plan(cfg, "t", "llama", layers, **{extra: 1})


# ---- configs with the flags switched: transformers on the meta device is the reference -------------

# (model_type, overrides of transformers' default config): all but qwen3 were miscounted while the
# families patched totals with extra_* terms (biases never counted, or counted where absent)
SWITCHED = [
    ("llama", {"attention_bias": True, "mlp_bias": True}),
    ("qwen3", {"attention_bias": True}),
    ("qwen2_moe", {"qkv_bias": False}),
    ("qwen3_next", {"attention_bias": True}),
    ("falcon_h1", {"attention_bias": True, "mlp_bias": True, "mamba_proj_bias": True, "projectors_bias": True,
                   "mamba_conv_bias": False, "mamba_rms_norm": True}),
    ("granitemoehybrid", {"attention_bias": True, "mamba_proj_bias": True, "mamba_conv_bias": False}),
    ("jamba", {"mamba_proj_bias": True, "mamba_conv_bias": False}),
    ("lfm2", {"conv_bias": True, "num_hidden_layers": 4,  # transformers' default is all attention
              "layer_types": ["conv", "full_attention", "conv", "conv"]}),
    ("kimi_linear", {"attention_bias": True}),
    ("kimi_linear", {"attention_bias": True, "q_lora_rank": 64}),  # q_a_proj has a bias too
    ("nemotron_h", {"mlp_bias": True, "use_bias": True, "use_conv_bias": False}),
]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    import torch

    transformers.logging.set_verbosity_error()
    return transformers, torch


@pytest.mark.parametrize("model_type,overrides", SWITCHED)
def test_switched_flags_match_transformers(hf, model_type, overrides):
    transformers, torch = hf
    cfg = transformers.AutoConfig.for_model(model_type, **overrides)
    data = json.loads(cfg.to_json_string())
    assert all(data[k] == v for k, v in overrides.items())  # transformers kept the switches
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert read_plan(data).params.total == sum(p.numel() for p in model.parameters())
