"""Pieces every family adapter shares: standard attention/MLP/MoE fields and the plan's common part."""

from __future__ import annotations

from kvstate.config.fields import ConfigView
from kvstate.config.params import estimate_params
from kvstate.config.plan import AttentionSpec, FfnSpec, LayerSpec, ModelPlan

# Layer-type strings in configs -> "full" | "linear" | "conv" | "mlp" | "moe".
# "mamba" / "attention" are the legacy spellings transformers still remaps.
LAYER_TYPE_WORDS: dict[str, str] = {
    "full_attention": "full", "attention": "full",
    "linear_attention": "linear", "mamba": "linear",
    "conv": "conv",
    "mlp": "mlp", "moe": "moe",
}


def layer_words(cfg: ConfigView, names: tuple[str, ...], allowed: set[str]) -> list[str]:
    """Read a per-layer type list (e.g. `layer_types`), normalized by LAYER_TYPE_WORDS.

    Checks each entry against `allowed` and the length against num_hidden_layers."""
    values = cfg.list(*names)
    where = tuple(n for n in names if cfg.has(n))[:1] or names
    if not values:
        raise cfg.error(where, "is empty")
    words = []
    for i, v in enumerate(values):
        word = LAYER_TYPE_WORDS.get(v) if isinstance(v, str) else None
        if word not in allowed:
            accepted = sorted(k for k, w in LAYER_TYPE_WORDS.items() if w in allowed)
            raise cfg.error(where, f"entry {i} is {v!r}; accepted: {', '.join(accepted)}")
        words.append(word)
    cfg.layer_count_check(where, len(words), "the list")
    return words


def attention(cfg: ConfigView, output_gate: bool = False, head_dim_keys: tuple[str, ...] = ("head_dim",), *,
              qk_norm: bool = False, qkv_bias: bool = False, o_bias: bool = False) -> AttentionSpec:
    """Standard attention fields; num_key_value_heads defaults to the head count (MHA) and
    head_dim to hidden_size / num_attention_heads, as in transformers. The family says which
    norms and biases its attention has (`attention_bias(cfg)` where the config decides)."""
    heads = cfg.int("num_attention_heads")
    kv_heads = cfg.int("num_key_value_heads", default=heads)
    head_dim = cfg.int(*head_dim_keys, default=None)  # given, or transformers' default (Qwen3-Next: 256)
    if head_dim is None:
        hidden = cfg.int("hidden_size")
        if hidden % heads:
            raise cfg.error(head_dim_keys, f"missing, and hidden_size {hidden} is not divisible by "
                            f"num_attention_heads {heads}")
        head_dim = hidden // heads
    if heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    return AttentionSpec(heads, kv_heads, head_dim, output_gate, qk_norm=qk_norm, qkv_bias=qkv_bias, o_bias=o_bias)


def attention_bias(cfg: ConfigView) -> bool:
    """`attention_bias` (default false): biases on q, k, v and o projections where a family honours it."""
    return cfg.bool("attention_bias", default=False)


def mlp(cfg: ConfigView, *names: str, gated: bool = True, bias: bool = False) -> FfnSpec:
    return FfnSpec("mlp", intermediate_size=cfg.int(*(names or ("intermediate_size",))), gated=gated, bias=bias)


def moe(cfg: ConfigView, experts: tuple[str, ...], top_k: tuple[str, ...], width: tuple[str, ...],
        shared_width: int = 0, gated: bool = True) -> FfnSpec:
    return FfnSpec("moe", gated=gated, num_experts=cfg.int(*experts), experts_per_token=cfg.int(*top_k),
                   expert_intermediate_size=cfg.int(*width), shared_intermediate_size=shared_width)


def build_plan(cfg: ConfigView, name: str, model_type: str, layers: list[LayerSpec], *,
               max_position: tuple[str, ...] = ("max_position_embeddings",), tie_default: bool = False) -> ModelPlan:
    """The fields every family shares, then the parameter estimate (from the layer specs alone)."""
    hidden, vocab = cfg.int("hidden_size"), cfg.int("vocab_size")
    tied = cfg.bool("tie_word_embeddings", "tie_embedding", default=tie_default)
    layers_t = tuple(layers)
    return ModelPlan(
        name=name,
        model_type=model_type,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=len(layers_t),
        max_position_embeddings=cfg.int(*max_position, default=None),
        # no dtype in the config: checkpoints of these families ship bf16 weights
        dtype=cfg.dtype("dtype", "torch_dtype", default="bfloat16"),
        state_dtype=cfg.dtype("mamba_ssm_dtype", "mamba_ssm_cache_dtype", default="float32"),
        tie_word_embeddings=tied,
        params=estimate_params(layers_t, hidden, vocab, tied),
        layers=layers_t,
        source=cfg.source,
        config=dict(cfg.data),
    )
