"""Kimi Linear: KDA layers plus MLA layers (no RoPE), MoE FFNs after the first dense layers.

Traps (reference/model-configs.md): `linear_attn_config.full_attn_layers` / `kda_layers` are
1-indexed; the top-level `head_dim` (72) is not a cache dimension; the context limit is
`model_max_length`. An MLA layer caches one latent of kv_lora_rank + qk_rope_head_dim per token.

Weights: original checkpoints (and transformers' save_pretrained, which writes that format) name
the FFNs `block_sparse_moe`, keep per-expert w1/w3/w2 and separate q/k/v short convs; transformers'
in-memory names fuse the conv and nest the forget gate. Both load; the KDA q/k/v projections and
convs become row blocks of our fused weights.
"""

from __future__ import annotations

import re

from kvstate.config.fields import ConfigView
from kvstate.config.options import ModelOptions
from kvstate.config.plan import FfnSpec, KDASpec, LayerSpec, MLASpec, ModelPlan
from kvstate.families._common import build_plan, layer_words, mlp
from kvstate.families._options import eps
from kvstate.families._weights import Target, common_targets

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


def _sparse(cfg: ConfigView) -> list[bool]:
    """MoE or dense FFN per layer: `mlp_layer_types` ("dense" | "sparse", what transformers saves),
    else dense for the first `first_k_dense_replace` layers."""
    n = cfg.int("num_hidden_layers")
    if cfg.has("mlp_layer_types"):
        values = cfg.list("mlp_layer_types")
        for i, v in enumerate(values):
            if v not in ("dense", "sparse"):
                raise cfg.error("mlp_layer_types", f"entry {i} is {v!r}; accepted: dense, sparse")
        cfg.layer_count_check(("mlp_layer_types",), len(values), "the list")
        return [v == "sparse" for v in values]
    first_dense = cfg.int("first_k_dense_replace", default=1, minimum=0)
    return [i >= first_dense for i in range(n)]


def read(cfg: ConfigView, name: str) -> ModelPlan:
    words = _words(cfg)
    mla = MLASpec(
        num_heads=cfg.int("num_attention_heads"),
        kv_lora_rank=cfg.int("kv_lora_rank"),
        qk_nope_head_dim=cfg.int("qk_nope_head_dim"),
        qk_rope_head_dim=cfg.int("qk_rope_head_dim"),
        v_head_dim=cfg.int("v_head_dim"),
        q_lora_rank=cfg.int("q_lora_rank", default=None),
        bias=cfg.bool("attention_bias", default=False),
    )
    kda = _kda(cfg)
    sparse_layers = _sparse(cfg)
    experts = ("num_experts", "num_local_experts")
    sparse = FfnSpec(
        "moe", num_experts=cfg.int(*experts), experts_per_token=cfg.int("num_experts_per_token", "num_experts_per_tok"),
        expert_intermediate_size=cfg.int("moe_intermediate_size"),
        shared_intermediate_size=cfg.int("num_shared_experts", "n_shared_experts", default=0, minimum=0)
        * cfg.int("moe_intermediate_size"))
    dense = mlp(cfg)
    layers = [LayerSpec(i, (mla if w == "full" else kda,), sparse if sparse_layers[i] else dense)
              for i, w in enumerate(words)]
    return build_plan(cfg, name, "kimi_linear", layers,
                      max_position=("model_max_length", "max_position_embeddings"))


# -- model building (kvstate.models) -------------------------------------------------------------

_ALIASES = ((r"\.block_sparse_moe\.", ".mlp."),  # original checkpoints name every FFN block_sparse_moe
            (r"\.self_attn\.forget_gate\.", ".self_attn."))  # transformers' in-memory forget-gate module
_KDA_QKV = re.compile(r"layers\.(\d+)\.self_attn\.([qkv])_(proj|conv1d)\.weight")
_RULES = ((r"layers\.(\d+)\.self_attn\.conv1d\.weight", r"layers.\1.mixer.conv_weight"),  # fused q/k/v conv
          (r"layers\.(\d+)\.self_attn\.(A_log|dt_bias)", r"layers.\1.mixer.\2"))


def model_options(cfg: ConfigView) -> ModelOptions:
    """Plain RMSNorm, no positions in MLA, sigmoid grouped routing with a correction bias and a scale."""
    router = {"kind": "sigmoid", "norm_topk": cfg.bool("moe_renormalize", "norm_topk_prob", default=True),
              "num_groups": cfg.int("num_expert_group", "n_group", default=1),
              "topk_groups": cfg.int("topk_group", default=1),
              "scaling": float(cfg.raw("routed_scaling_factor", default=2.446))}  # transformers' default
    act = cfg.str("hidden_act", default="silu")
    return ModelOptions(norm_eps=eps(cfg, default=1e-5), act=act, rope_theta=None, router=router,
                        mixer={"kda": {"act": act}})  # the short conv uses hidden_act too


def weight_targets(name: str, plan) -> list[Target] | None:
    for pattern, repl in _ALIASES:
        name = re.sub(pattern, repl, name)
    m = _KDA_QKV.fullmatch(name[len("model."):] if name.startswith("model.") else name)
    if m and int(m[1]) < plan.num_layers and plan.layers[int(m[1])].kinds == ("kda",):
        # q/k/v projections and convs are the row blocks of our fused qkv_proj / conv_weight
        layer, part = int(m[1]), "qkv".index(m[2])
        width = plan.layers[layer].mixers[0].num_heads * plan.layers[layer].mixers[0].head_dim
        param = "qkv_proj.weight" if m[3] == "proj" else "conv_weight"
        return [Target(f"layers.{layer}.mixer.{param}", (slice(part * width, (part + 1) * width),))]
    shared = re.search(r"layers\.(\d+)\.mlp\.shared_experts\.", name)
    if shared and int(shared[1]) < plan.num_layers and plan.layers[int(shared[1])].ffn.shared_intermediate_size == 0:
        return []  # num_shared_experts = 0: transformers still saves zero-width shared experts
    return common_targets(name, plan, extra_rules=_RULES)
