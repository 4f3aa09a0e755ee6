"""Kimi Linear: KDA layers plus MLA layers (no RoPE), MoE FFNs after the first dense layers.

Traps (reference/model-configs.md): `linear_attn_config.full_attn_layers` / `kda_layers` are
1-indexed; the top-level `head_dim` (72) is not a cache dimension; the context limit is
`model_max_length`. An MLA layer caches one latent of kv_lora_rank + qk_rope_head_dim per token.
"""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.plan import FfnSpec, KDASpec, LayerSpec, MLASpec, ModelPlan
from kvstate.families._common import build_plan, layer_words, mlp

MODEL_TYPES = ("kimi_linear",)


def _words(cfg: ConfigView) -> list[str]:
    """Full/linear per layer from linear_attn_config's 1-indexed lists (or `layer_types`)."""
    if cfg.has("layer_types"):
        return layer_words(cfg, ("layer_types",), {"full", "linear"})
    lin = cfg.sub("linear_attn_config")
    n = cfg.int("num_hidden_layers")
    words: list[str | None] = [None] * n
    for key, word in (("full_attn_layers", "full"), ("kda_layers", "linear")):
        for number in lin.int_list(key, minimum=1):
            if number > n:
                raise lin.error(key, f"layer {number} is past num_hidden_layers {n} (the list is 1-indexed)")
            if words[number - 1] is not None:
                raise lin.error(key, f"layer {number} is listed twice")
            words[number - 1] = word
    if None in words:
        missing = [i + 1 for i, w in enumerate(words) if w is None]
        raise lin.error(("full_attn_layers", "kda_layers"),
                        f"together cover {n - len(missing)} of num_hidden_layers {n}; missing {missing}")
    return words  # type: ignore[return-value]


def _kda(cfg: ConfigView) -> KDASpec:
    if cfg.has("linear_attn_config"):
        lin = cfg.sub("linear_attn_config")
        return KDASpec(lin.int("num_heads"), lin.int("head_dim"), lin.int("short_conv_kernel_size"))
    return KDASpec(cfg.int("linear_num_heads"), cfg.int("linear_head_dim"), cfg.int("linear_conv_kernel_dim"))


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = _words(cfg)
    mla = MLASpec(
        num_heads=cfg.int("num_attention_heads"),
        kv_lora_rank=cfg.int("kv_lora_rank"),
        qk_nope_head_dim=cfg.int("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.int("qk_rope_head_dim"),
        v_head_dim=cfg.int("v_head_dim"),
        q_lora_rank=cfg.int("q_lora_rank", default=None),
    )
    kda = _kda(cfg)
    first_dense = cfg.int("first_k_dense_replace", default=1, minimum=0)
    experts = ("num_experts", "num_local_experts")
    sparse = FfnSpec(
        "moe", num_experts=cfg.int(*experts), experts_per_token=cfg.int("num_experts_per_token", "num_experts_per_tok"),
        expert_intermediate_size=cfg.int("moe_intermediate_size"),
        shared_intermediate_size=cfg.int("num_shared_experts", "n_shared_experts", default=0, minimum=0)
        * cfg.int("moe_intermediate_size"))
    dense = mlp(cfg)
    layers = [LayerSpec(i, (mla if w == "full" else kda,), dense if i < first_dense else sparse)
              for i, w in enumerate(words)]
    return build_plan(cfg, name, "kimi_linear", layers,
                      max_position=("model_max_length", "max_position_embeddings"))
