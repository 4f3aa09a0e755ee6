"""GGUF metadata back to config.json for LFM2, Falcon-H1, Jamba and Granite 4.0 hybrid (torch-free).

What the converter leaves out of the metadata is read from the tensors: which blocks are attention
(the attn_q tensor), the biases (a `.bias` tensor) and the tied head (no `output.weight`).
- lfm2 (conversion/lfm2.py): `attention.head_count_kv` per layer, 0 on a conv layer; the MLP width is
  already the auto-adjusted one.
- falcon-h1 (conversion/falcon_h1.py): the muP multipliers are multiplied into the weights, so the
  config has none (every multiplier 1); llama.cpp gates the Mamba output before its optional norm.
- jamba (conversion/jamba.py): which layers are attention and which MoE is written per layer only (the
  attn_q and ffn_gate_exps tensors); the config's period and offset are read back from those.
- granitehybrid (conversion/granite.py: GraniteHybridModel): the granite scales are keys; RoPE only when
  `rope.scaling.finetuned` (the converter's "use_rope"); per-layer `head_count_kv` is not to be trusted
  (a transformers 5 config spells the layer types so that the converter finds no attention layer).
"""

from __future__ import annotations

from typing import Any

from kvstate.errors import KvstateError
from kvstate.gguf.fields import arch_field, field, has_tensor, tensor_names


def _attention_layers(reader, layers: int) -> list[bool]:
    names = tensor_names(reader)
    return [f"blk.{i}.attn_q.weight" in names for i in range(layers)]


def _first(flags: list[bool], want: bool) -> int | None:
    return flags.index(want) if want in flags else None


def _kv_heads(reader, arch: str, attn: list[bool], head_dim: int) -> int:
    """KV heads of the first attention block, from its attn_k rows (GGUF shapes list the rows last)."""
    i = _first(attn, True)
    if i is None:
        kv = arch_field(reader, arch, "attention.head_count_kv")
        return max(kv) if isinstance(kv, list) else kv
    return int(tensor_names(reader)[f"blk.{i}.attn_k.weight"].shape[-1]) // head_dim


def lfm2(reader, arch: str) -> dict[str, Any]:
    def get(key, default=None):
        return arch_field(reader, arch, key, default)

    layers, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    attn = _attention_layers(reader, layers)
    conv = _first(attn, False)
    return dict(model_type="lfm2", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=_kv_heads(reader, arch, attn, hidden // heads),
                layer_types=["full_attention" if a else "conv" for a in attn],
                intermediate_size=get("feed_forward_length"), block_auto_adjust_ff_dim=False,
                conv_L_cache=get("shortconv.l_cache"), norm_eps=get("attention.layer_norm_rms_epsilon"),
                rope_theta=get("rope.freq_base", 1e6), max_position_embeddings=get("context_length"),
                conv_bias=conv is not None and has_tensor(reader, f"blk.{conv}.shortconv.in_proj.bias"),
                tie_word_embeddings=not has_tensor(reader, "output.weight"))


def falcon_h1(reader, arch: str) -> dict[str, Any]:
    def get(key, default=None):
        return arch_field(reader, arch, key, default)

    inner, heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    blk = lambda name: has_tensor(reader, f"blk.0.{name}")  # noqa: E731  every block has both mixers
    return dict(model_type="falcon_h1", hidden_size=get("embedding_length"), num_hidden_layers=get("block_count"),
                num_attention_heads=get("attention.head_count"), num_key_value_heads=get("attention.head_count_kv"),
                head_dim=get("attention.key_length"), intermediate_size=get("feed_forward_length"),
                mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
                mamba_d_state=get("ssm.state_size"), mamba_n_groups=get("ssm.group_count"),
                mamba_d_conv=get("ssm.conv_kernel"), mamba_rms_norm=blk("ssm_norm.weight"),
                mamba_norm_before_gate=False, mamba_conv_bias=blk("ssm_conv1d.bias"),
                mamba_proj_bias=blk("ssm_in.bias"), projectors_bias=blk("ssm_out.bias"),
                attention_bias=blk("attn_q.bias"), mlp_bias=blk("ffn_up.bias"),
                rms_norm_eps=get("attention.layer_norm_rms_epsilon"), rope_theta=get("rope.freq_base", 10000.0),
                max_position_embeddings=get("context_length"), hidden_act="silu",
                tie_word_embeddings=not has_tensor(reader, "output.weight"))


def granitehybrid(reader, arch: str) -> dict[str, Any]:
    def get(key, default=None):
        return arch_field(reader, arch, key, default)

    layers, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    inner, mamba_heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    if inner % hidden:
        raise KvstateError(f"{reader.source}: {arch}.ssm.inner_size {inner} is not a multiple of the "
                           f"embedding length {hidden}")
    attn = _attention_layers(reader, layers)
    names = tensor_names(reader)
    experts = field(reader, f"{arch}.expert_count", 0)
    shared = field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is None:  # no experts: the shared MLP alone, its width from its tensor
        up = names.get("blk.0.ffn_up_shexp.weight")
        if up is None:
            raise KvstateError(f"{reader.source}: GGUF metadata has no {arch}.expert_shared_feed_forward_length")
        shared = int(up.shape[-1])
    mamba, first_attn = _first(attn, False), _first(attn, True)
    cfg = dict(model_type="granitemoehybrid", hidden_size=hidden, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=_kv_heads(reader, arch, attn, hidden // heads),
               layer_types=["attention" if a else "mamba" for a in attn],
               mamba_n_heads=mamba_heads, mamba_d_head=inner // mamba_heads, mamba_expand=inner // hidden,
               mamba_d_state=get("ssm.state_size"), mamba_n_groups=get("ssm.group_count"),
               mamba_d_conv=get("ssm.conv_kernel"), shared_intermediate_size=shared,
               num_local_experts=experts, num_experts_per_tok=field(reader, f"{arch}.expert_used_count", 0),
               intermediate_size=get("feed_forward_length", 0),
               mamba_conv_bias=mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in names,
               mamba_proj_bias=mamba is not None and f"blk.{mamba}.ssm_in.bias" in names,
               attention_bias=first_attn is not None and f"blk.{first_attn}.attn_q.bias" in names,
               rms_norm_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length"),
               position_embedding_type="rope" if field(reader, f"{arch}.rope.scaling.finetuned") else "nope",
               rope_theta=get("rope.freq_base", 10000.0),
               tie_word_embeddings=not has_tensor(reader, "output.weight"))
    for key, hf in (("embedding_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
                    ("logit_scale", "logits_scaling"), ("attention.scale", "attention_multiplier")):
        if (value := field(reader, f"{arch}.{key}")) is not None:
            cfg[hf] = value
    return cfg


def _period(reader, what: str, layers: list[int], n: int) -> tuple[int, int]:
    """(period, offset) with layer i chosen iff i % period == offset, for the chosen `layers` of `n`."""
    if not layers:
        return n + 1, n  # none chosen
    period = layers[1] - layers[0] if len(layers) > 1 else n
    offset = layers[0]
    if offset >= period or [i for i in range(n) if i % period == offset] != layers:
        raise KvstateError(f"{reader.source}: the {what} layers {layers} are not every k-th layer from an offset "
                           "below k (as Jamba's config says them)")
    return period, offset


def jamba(reader, arch: str) -> dict[str, Any]:
    def get(key, default=None):
        return arch_field(reader, arch, key, default)

    layers, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    inner = get("ssm.inner_size")
    attn = _attention_layers(reader, layers)
    names = tensor_names(reader)
    attn_period, attn_offset = _period(reader, "attention", [i for i, a in enumerate(attn) if a], layers)
    moe = [i for i in range(layers) if f"blk.{i}.ffn_gate_exps.weight" in names]
    exp_period, exp_offset = _period(reader, "MoE", moe, layers)
    mamba = _first(attn, False)
    return dict(model_type="jamba", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=_kv_heads(reader, arch, attn, hidden // heads),
                attn_layer_period=attn_period, attn_layer_offset=attn_offset,
                expert_layer_period=exp_period, expert_layer_offset=exp_offset,
                num_experts=get("expert_count") if moe else 1, num_experts_per_tok=get("expert_used_count", 1),
                intermediate_size=get("feed_forward_length"), mamba_expand=inner // hidden,
                mamba_d_state=get("ssm.state_size"), mamba_d_conv=get("ssm.conv_kernel"),
                mamba_dt_rank=get("ssm.time_step_rank"),
                mamba_conv_bias=mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in names,
                mamba_proj_bias=mamba is not None and f"blk.{mamba}.ssm_in.bias" in names,
                rms_norm_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length"),
                hidden_act="silu", tie_word_embeddings=not has_tensor(reader, "output.weight"))


def kimi_linear(reader, arch: str) -> dict[str, Any]:
    """kimi-linear (conversion/kimi_linear.py): `head_count_kv` per layer, 0 on a KDA layer (1 on an MLA
    layer: its latent is one KV head); the KDA head count is not written (llama.cpp takes the attention
    head count): it is read from the KDA q projection. llama.cpp routes with sigmoid scores and always
    renormalizes the chosen experts' weights."""
    def get(key, default=None):
        return arch_field(reader, arch, key, default)

    layers, heads = get("block_count"), get("attention.head_count")
    kv = get("attention.head_count_kv")
    full = [bool(k) for k in kv] if isinstance(kv, list) else _attention_layers(reader, layers)
    names = tensor_names(reader)
    kda_layer, mla_layer = _first(full, False), _first(full, True)
    kda_dim = get("kda.head_dim")
    kda_heads = heads if kda_layer is None else int(names[f"blk.{kda_layer}.attn_q.weight"].shape[-1]) // kda_dim
    if field(reader, f"{arch}.expert_gating_func", 2) != 2:  # gguf.ExpertGatingFuncType.SIGMOID
        raise KvstateError(f"{reader.source}: {arch}.expert_gating_func is not sigmoid, which Kimi Linear routes by")
    rope = get("rope.dimension_count")
    cfg = dict(model_type="kimi_linear", hidden_size=get("embedding_length"), num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=heads,
               layer_types=["full_attention" if f else "linear_attention" for f in full],
               linear_num_heads=kda_heads, linear_head_dim=kda_dim, linear_conv_kernel_dim=get("ssm.conv_kernel"),
               kv_lora_rank=get("attention.kv_lora_rank"), q_lora_rank=field(reader, f"{arch}.attention.q_lora_rank"),
               qk_rope_head_dim=rope, qk_nope_head_dim=get("attention.key_length_mla") - rope,
               v_head_dim=get("attention.value_length_mla"),
               attention_bias=mla_layer is not None and f"blk.{mla_layer}.attn_kv_a_mqa.bias" in names,
               mlp_layer_types=["sparse" if f"blk.{i}.ffn_gate_exps.weight" in names else "dense"
                                for i in range(layers)],
               intermediate_size=get("feed_forward_length"), num_experts=get("expert_count"),
               num_experts_per_token=get("expert_used_count"), moe_intermediate_size=get("expert_feed_forward_length"),
               num_shared_experts=get("expert_shared_count", 0), moe_renormalize=True,
               num_expert_group=get("expert_group_count", 1), topk_group=get("expert_group_used_count", 1),
               routed_scaling_factor=get("expert_weights_scale", 1.0),
               rms_norm_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length"),
               hidden_act="silu", tie_word_embeddings=not has_tensor(reader, "output.weight"))
    return cfg
