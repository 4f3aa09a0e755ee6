"""Qwen3-Next: like Qwen3.5 but a flat config, usually without `layer_types`.

Full attention where (i + 1) % full_attention_interval == 0. The FFN of layer i is the sparse
MoE unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (then a dense MLP of
`intermediate_size`), as transformers' Qwen3NextDecoderLayer decides.
"""

from __future__ import annotations

import re

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import GatedDeltaNetSpec, LayerSpec, ModelPlan
from kvstate.families import qwen3_5
from kvstate.families._common import build_plan, mlp
from kvstate.families._weights import Target
from kvstate.families.qwen3_5 import full_or_linear, gated_deltanet, qwen_attention, qwen_moe, with_mtp

MODEL_TYPES = ("qwen3_next",)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = full_or_linear(cfg)
    attn = qwen_attention(cfg)
    gdn = gated_deltanet(cfg)
    dense_only = set(cfg.int_list("mlp_only_layers")) if cfg.has("mlp_only_layers") else set()
    step = cfg.int("decoder_sparse_step", default=1)
    sparse = cfg.int("num_experts", minimum=0) > 0
    layers = []
    for i, w in enumerate(words):
        is_moe = sparse and i not in dense_only and (i + 1) % step == 0
        ffn = qwen_moe(cfg) if is_moe else mlp(cfg)
        layers.append(LayerSpec(i, (attn if w == "full" else gdn,), ffn))
    return with_mtp(build_plan(cfg, name, "qwen3_next", layers), cfg, attn, qwen_moe(cfg) if sparse else mlp(cfg))


# -- model building (kvstate.models) -------------------------------------------------------------
# The Gated DeltaNet layer is Qwen3.5's (separate in_proj_qkv / _z / _b / _a). Qwen3-Next stores
# them fused and interleaved per key head h (r = num_v_heads / num_k_heads value heads each):
#   in_proj_qkvz rows: [h][q: dk | k: dk | v: r*dv | z: r*dv]     in_proj_ba rows: [h][b: r | a: r]
# (transformers' fix_query_key_value_ordering), so the loader picks those rows apart.

_FUSED = re.compile(r"(?:model\.)?layers\.(\d+)\.linear_attn\.in_proj_(qkvz|ba)\.weight")


def model_options(cfg: ConfigView) -> ModelOptions:
    """As Qwen3.5: zero-centred RMSNorm, q/k norm, partial rotary, softmax top-k with a gated shared expert."""
    return qwen3_5.model_options(cfg)


def _rows(blocks: int, period: int, start: int, width: int) -> tuple[int, ...]:
    """Rows start .. start+width-1 of every one of `blocks` consecutive blocks of `period` rows."""
    return tuple(b * period + start + j for b in range(blocks) for j in range(width))


def fused_gdn_targets(layer: int, which: str, spec: GatedDeltaNetSpec) -> list[Target]:
    """Targets of the fused in_proj_qkvz / in_proj_ba of one layer in the separate projections."""
    nk, dk, dv = spec.num_k_heads, spec.head_k_dim, spec.head_v_dim
    r = spec.num_v_heads // nk
    base = f"layers.{layer}.mixer"
    if which == "ba":
        return [Target(f"{base}.in_proj_b.weight", rows=_rows(nk, 2 * r, 0, r)),
                Target(f"{base}.in_proj_a.weight", rows=_rows(nk, 2 * r, r, r))]
    period = 2 * dk + 2 * r * dv
    qkv = _rows(nk, period, 0, dk) + _rows(nk, period, dk, dk) + _rows(nk, period, 2 * dk, r * dv)
    return [Target(f"{base}.in_proj_qkv.weight", rows=qkv),
            Target(f"{base}.in_proj_z.weight", rows=_rows(nk, period, 2 * dk + r * dv, r * dv))]


def weight_targets(name: str, plan) -> list[Target] | None:
    m = _FUSED.fullmatch(name)
    if m is None:
        return qwen3_5.weight_targets(name, plan)
    layer = int(m[1])
    mixers = plan.layers[layer].mixers if layer < plan.num_layers else ()
    if not mixers or not isinstance(mixers[0], GatedDeltaNetSpec):
        return None  # a linear-attention tensor in a layer the config makes full attention
    return fused_gdn_targets(layer, m[2], mixers[0])
