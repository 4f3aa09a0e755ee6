"""Qwen3-Next: like Qwen3.5 but a flat config, usually without `layer_types`.

Full attention where (i + 1) % full_attention_interval == 0. The FFN of layer i is the sparse
MoE unless i is in `mlp_only_layers` or (i + 1) % decoder_sparse_step != 0 (then a dense MLP of
`intermediate_size`), as transformers' Qwen3NextDecoderLayer decides.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import LayerSpec, ModelPlan
from kvstate.families._common import attention, build_plan, mlp
from kvstate.families.qwen3_5 import full_or_linear, gated_deltanet, qwen_moe

MODEL_TYPES = ("qwen3_next",)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = full_or_linear(cfg)
    attn = attention(cfg, output_gate=cfg.bool("attn_output_gate", default=True))
    gdn = gated_deltanet(cfg)
    dense_only = set(cfg.int_list("mlp_only_layers")) if cfg.has("mlp_only_layers") else set()
    step = cfg.int("decoder_sparse_step", default=1)
    sparse = cfg.int("num_experts", minimum=0) > 0
    layers = []
    for i, w in enumerate(words):
        is_moe = sparse and i not in dense_only and (i + 1) % step == 0
        ffn = qwen_moe(cfg) if is_moe else mlp(cfg)
        layers.append(LayerSpec(i, (attn if w == "full" else gdn,), ffn))
    n_moe = sum(layer.ffn.kind == "moe" for layer in layers)
    return build_plan(cfg, name, "qwen3_next", layers,
                      extra_attention=words.count("full") * 2 * attn.head_dim,
                      extra_moe=n_moe * cfg.int("hidden_size"))
