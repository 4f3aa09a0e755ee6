"""Nemotron-H: a sequence of single-purpose blocks (Mamba-2, attention, MLP or MoE).

The block list is `hybrid_override_pattern` (M Mamba-2, * attention, - MLP, E MoE) or, in newer
exports, `layers_block_type` ("mamba"/"linear_attention", "attention"/"full_attention", "mlp",
"moe"). MLP and MoE blocks hold no cache. Key spellings vary between exports (D_STATE, N_GROUPS, ...);
the attention head_dim is explicit (Nemotron-Nano-9B-v2: 128, not hidden / heads = 112).

Model building: each block has one pre-norm (`layers.N.norm`) and one `layers.N.mixer`, which is
our block's mixer (Mamba-2, attention without RoPE) or its FFN (relu^2 MLP; MoE with a sigmoid
router, correction bias, group-limited top-k, non-gated relu^2 experts, one shared expert and an
optional latent projection). The chunked Mamba-2 scan clamps dt below at time_step_min (transformers'
NemotronH ignores time_step_limit; like it, decode steps do not clamp).
"""

from __future__ import annotations

import math

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import FFN_NONE, FfnSpec, LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import attention, build_plan, layer_words, mlp
from kvstate.families._options import eps
from kvstate.families._weights import Target, expert_target
from kvstate.families.mamba2 import config_float, layer_targets, mamba2_biases, mamba_options

MODEL_TYPES = ("nemotron_h",)

PATTERN_WORDS = {"M": "linear", "*": "full", "-": "mlp", "E": "moe"}
D_STATE = ("ssm_state_size", "mamba_state_dim", "mamba_d_state")
N_GROUPS = ("n_groups", "mamba_num_groups", "mamba_n_groups")
CONV = ("conv_kernel", "mamba_d_conv")


def _blocks(cfg: ConfigView) -> list[str]:
    if cfg.has("layers_block_type"):
        return layer_words(cfg, ("layers_block_type",), {"full", "linear", "mlp", "moe"})
    pattern = cfg.str("hybrid_override_pattern")
    if not pattern:
        raise cfg.error("hybrid_override_pattern", "is empty")
    bad = sorted(set(pattern) - set(PATTERN_WORDS))
    if bad:
        raise cfg.error("hybrid_override_pattern", f"unknown block letters {bad}; accepted: M * - E")
    cfg.layer_count_check(("hybrid_override_pattern",), len(pattern), "the pattern")
    return [PATTERN_WORDS[c] for c in pattern]


def _mamba(cfg: ConfigView) -> Mamba2Spec:
    # mamba_head_dim left out: transformers' default (64), not expand x hidden / heads
    return Mamba2Spec(cfg.int("mamba_num_heads"), cfg.int("mamba_head_dim"), cfg.int(*D_STATE), cfg.int(*N_GROUPS),
                      cfg.int(*CONV), **mamba2_biases(cfg))


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = _blocks(cfg)
    mixers = {}
    if "linear" in words:
        mixers["linear"] = (_mamba(cfg),)
    if "full" in words:
        mixers["full"] = (attention(cfg),)  # transformers' NemotronH attention has no biases
    ffns: dict[str, FfnSpec] = {}
    bias = cfg.bool("mlp_bias", default=False)  # the MLPs, the shared expert, the latent projections
    if "mlp" in words:
        ffns["mlp"] = mlp(cfg, gated=False, bias=bias)  # relu2: up_proj, down_proj
    if "moe" in words:  # transformers builds one shared expert of this width whatever n_shared_experts says
        ffns["moe"] = FfnSpec(
            "moe", gated=False, num_experts=cfg.int("n_routed_experts", "num_local_experts"),
            experts_per_token=cfg.int("num_experts_per_tok"),
            expert_intermediate_size=cfg.int("moe_intermediate_size"),
            shared_intermediate_size=cfg.int("moe_shared_expert_intermediate_size", minimum=0),
            latent_size=cfg.int("moe_latent_size", default=0, minimum=0), bias=bias)
    layers = [LayerSpec(i, mixers.get(w, ()), ffns.get(w, FFN_NONE)) for i, w in enumerate(words)]
    return build_plan(cfg, name, "nemotron_h", layers)


# -- model building (kvstate.models) -------------------------------------------------------------

_PREFIXES = ("backbone.", "model.")  # checkpoints: backbone.*; transformers' in-memory names: model.*
_FUSED_EXPERTS = {"experts.up_proj": "experts.gate_up", "experts.down_proj": "experts.down"}


def model_options(cfg: ConfigView) -> ModelOptions:
    """relu^2 FFNs, attention without RoPE or biases, DeepSeek-style sigmoid routing."""
    t_min = config_float(cfg, "time_step_min", cfg.raw("time_step_min", "mamba_dt_min", default=0.001))
    return ModelOptions(
        norm_eps=eps(cfg, "layer_norm_epsilon", default=1e-5), act=cfg.str("mlp_hidden_act", default="relu2"),
        rope_theta=None,
        router={"kind": "sigmoid", "norm_topk": cfg.bool("norm_topk_prob", default=True),
                "num_groups": cfg.int("n_group", default=1), "topk_groups": cfg.int("topk_group", default=1),
                "scaling": float(cfg.raw("routed_scaling_factor", default=1.0))},
        mixer={"mamba2": mamba_options(cfg, limit=(t_min, math.inf), act=("mamba_hidden_act",))})


def _ffn_targets(plan, i: int, rest: str) -> list[Target] | None:
    """The `mixer.*` tensors of an MLP or MoE block -> our `ffn.*`."""
    if plan.layers[i].ffn.kind == "moe":
        per_expert = expert_target(f"layers.{i}.mixer.{rest}", lambda _: plan.layers[i].ffn, gated=False)
        if per_expert is not None:
            return per_expert
        rest = _FUSED_EXPERTS.get(rest, rest)
    return [Target(f"layers.{i}.ffn.{rest}")]


def weight_targets(name: str, plan) -> list[Target] | None:
    if name.startswith("mtp.") or ".mtp." in name:  # multi-token-prediction layers: not run here
        return []
    return layer_targets(name, plan, prefixes=_PREFIXES, ffn_rules=lambda i, rest: _ffn_targets(plan, i, rest))
