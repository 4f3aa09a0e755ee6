"""Granite 4.0 hybrid (granitemoehybrid): Mamba-2 layers with a few attention layers.

Every layer has a shared SwiGLU MLP of `shared_intermediate_size`; with num_local_experts > 0
it also has routed experts of `intermediate_size` (FFN kind "moe", the shared MLP counted as the
shared expert). Layers come from `layer_types` / `layers_block_type` ("mamba" | "attention").
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import FfnSpec, LayerSpec, Mamba2Spec, ModelPlan
from kvstate.families._common import attention, attention_bias, build_plan, layer_words
from kvstate.families.falcon_h1 import mamba_heads

MODEL_TYPES = ("granitemoehybrid",)


def read(cfg: ConfigView, name: str) -> ModelPlan:
    names = ("layer_types", "layers_block_type")
    if cfg.has(*names):
        words = layer_words(cfg, names, {"full", "linear"})
    else:  # transformers' default: all Mamba
        words = ["linear"] * cfg.int("num_hidden_layers")
    heads, head_dim = mamba_heads(cfg, cfg.int("mamba_expand") * cfg.int("hidden_size"))
    proj_bias = cfg.bool("mamba_proj_bias", default=False)  # in_proj and out_proj
    mamba = Mamba2Spec(heads, head_dim, cfg.int("mamba_d_state"), cfg.int("mamba_n_groups"), cfg.int("mamba_d_conv"),
                       in_proj_bias=proj_bias, out_proj_bias=proj_bias,
                       conv_bias=cfg.bool("mamba_conv_bias", default=True))
    bias = attention_bias(cfg)
    attn = attention(cfg, qkv_bias=bias, o_bias=bias)
    shared = cfg.int("shared_intermediate_size")
    experts = cfg.int("num_local_experts", default=0, minimum=0)
    if experts:
        ffn = FfnSpec("moe", num_experts=experts, experts_per_token=cfg.int("num_experts_per_tok"),
                      expert_intermediate_size=cfg.int("intermediate_size"), shared_intermediate_size=shared)
    else:
        ffn = FfnSpec("mlp", intermediate_size=shared)
    layers = [LayerSpec(i, (attn if w == "full" else mamba,), ffn) for i, w in enumerate(words)]
    return build_plan(cfg, name, "granitemoehybrid", layers)
