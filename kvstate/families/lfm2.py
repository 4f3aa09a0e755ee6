"""LFM2: gated short-convolution layers with a few attention layers, each followed by a SwiGLU MLP.

Layers come from `layer_types` ("full_attention" | "conv") or `full_attn_idxs` (0-indexed).
A conv layer keeps a window of `conv_L_cache` columns over hidden_size channels and no
recurrent state. The MLP width follows transformers' Lfm2MLP (auto-adjusted to 2/3, times
block_ffn_dim_multiplier, rounded up to block_multiple_of).

Model building: attention with per-head q/k RMSNorm (q_layernorm / k_layernorm, o_proj named
out_proj) and RoPE (theta 1e6 by default); the conv layers are `layers.short_conv.ShortConv`;
the SwiGLU MLP is w1 (gate), w3 (up), w2 (down); the final norm is `embedding_norm`.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import FfnSpec, LayerSpec, ModelPlan, ShortConvSpec
from kvstate.families._common import attention, build_plan, layer_words
from kvstate.families._options import eps, rope
from kvstate.families._weights import Target, common_targets

MODEL_TYPES = ("lfm2",)


def _words(cfg: ConfigView) -> list[str]:
    if cfg.has("layer_types"):
        return layer_words(cfg, ("layer_types",), {"full", "conv"})
    n = cfg.int("num_hidden_layers")
    full = set(cfg.int_list("full_attn_idxs"))
    if any(i >= n for i in full):
        raise cfg.error("full_attn_idxs", f"indices must be below num_hidden_layers {n}, got {sorted(full)}")
    return ["full" if i in full else "conv" for i in range(n)]


def _ffn_width(cfg: ConfigView) -> int:
    width = cfg.int("block_ff_dim", "intermediate_size")
    if cfg.bool("block_auto_adjust_ff_dim", default=True):
        width = int(2 * width / 3)
        multiplier = cfg.raw("block_ffn_dim_multiplier", default=1.0)
        if not isinstance(multiplier, (int, float)) or isinstance(multiplier, bool) or multiplier <= 0:
            raise cfg.error("block_ffn_dim_multiplier", f"must be a positive number, got {multiplier!r}")
        multiple = cfg.int("block_multiple_of", default=256)
        width = int(multiplier * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = _words(cfg)
    attn = attention(cfg, qk_norm=True)  # q_layernorm / k_layernorm, no biases
    conv = ShortConvSpec(cfg.int("hidden_size"), cfg.int("conv_L_cache"), bias=cfg.bool("conv_bias", default=False))
    ffn = FfnSpec("mlp", intermediate_size=_ffn_width(cfg))
    layers = [LayerSpec(i, (attn if w == "full" else conv,), ffn) for i, w in enumerate(words)]
    return build_plan(cfg, name, "lfm2", layers, tie_default=True)


# -- model building (kvstate.models) -------------------------------------------------------------

# LFM2's names -> the names common_targets knows (attention, MLP and norms as Llama spells them)
_SPELLINGS = {".self_attn.out_proj.": ".self_attn.o_proj.", ".q_layernorm.": ".q_norm.", ".k_layernorm.": ".k_norm.",
              ".operator_norm.": ".input_layernorm.", ".ffn_norm.": ".post_attention_layernorm.",
              ".feed_forward.w1.": ".mlp.gate_proj.", ".feed_forward.w3.": ".mlp.up_proj.",
              ".feed_forward.w2.": ".mlp.down_proj.", "model.embedding_norm.": "model.norm."}
_CONV = ((r"layers\.(\d+)\.conv\.conv\.(weight|bias)", r"layers.\1.mixer.conv_\2"),
         (r"layers\.(\d+)\.conv\.(in_proj|out_proj)\.(weight|bias)", r"layers.\1.mixer.\2.\3"))


def model_options(cfg: ConfigView) -> ModelOptions:
    return ModelOptions(norm_eps=eps(cfg, "norm_eps", default=1e-5), act="silu", **rope(cfg, default_theta=1e6))


def weight_targets(name: str, plan) -> list[Target] | None:
    for theirs, common in _SPELLINGS.items():
        name = name.replace(theirs, common)
    return common_targets(name, plan, extra_rules=_CONV)
