"""Nemotron-H: a sequence of single-purpose blocks (Mamba-2, attention, MLP or MoE).

The block list is `hybrid_override_pattern` (M Mamba-2, * attention, - MLP, E MoE) or, in newer
exports, `layers_block_type` ("mamba"/"linear_attention", "attention"/"full_attention", "mlp",
"moe"). MLP and MoE blocks hold no cache. Key spellings vary between exports (see _ALIASES);
the attention head_dim is explicit (Nemotron-Nano-9B-v2: 128, not hidden / heads = 112).
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import FFN_NONE, FfnSpec, LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import attention, build_plan, layer_words, mlp

MODEL_TYPES = ("nemotron_h",)

PATTERN_WORDS = {"M": "linear", "*": "full", "-": "mlp", "E": "moe"}
D_STATE = ("ssm_state_size", "mamba_state_dim", "mamba_d_state")
N_GROUPS = ("n_groups", "mamba_num_groups", "mamba_n_groups")
CONV = ("conv_kernel", "mamba_d_conv")
EXPAND = ("expand", "mamba_expand")


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
    heads = cfg.int("mamba_num_heads")
    if cfg.has("mamba_head_dim"):
        head_dim = cfg.int("mamba_head_dim")
    else:  # older exports: d_inner = expand x hidden split over the heads
        d_inner = cfg.int(*EXPAND) * cfg.int("hidden_size")
        if d_inner % heads:
            raise cfg.error("mamba_head_dim", f"missing, and expand x hidden_size {d_inner} is not divisible by "
                            f"mamba_num_heads {heads}")
        head_dim = d_inner // heads
    return Mamba2Spec(heads, head_dim, cfg.int(*D_STATE), cfg.int(*N_GROUPS), cfg.int(*CONV))


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = _blocks(cfg)
    mixers = {}
    if "linear" in words:
        mixers["linear"] = (_mamba(cfg),)
    if "full" in words:
        mixers["full"] = (attention(cfg),)
    ffns: dict[str, FfnSpec] = {}
    if "mlp" in words:
        ffns["mlp"] = mlp(cfg, gated=False)  # relu2: up_proj, down_proj
    if "moe" in words:
        shared = cfg.int("n_shared_experts", default=0, minimum=0)
        ffns["moe"] = FfnSpec(
            "moe", gated=False, num_experts=cfg.int("n_routed_experts", "num_local_experts"),
            experts_per_token=cfg.int("num_experts_per_tok"),
            expert_intermediate_size=cfg.int("moe_intermediate_size"),
            shared_intermediate_size=shared and shared * cfg.int("moe_shared_expert_intermediate_size"))
    layers = [LayerSpec(i, mixers.get(w, ()), ffns.get(w, FFN_NONE)) for i, w in enumerate(words)]
    return build_plan(cfg, name, "nemotron_h", layers)
