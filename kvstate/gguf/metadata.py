"""A GGUF file's metadata as the config.json its source checkpoint had (torch-free).

llama.cpp's converter writes `<arch>.*` keys from the HF config; `hf_config` writes them back
under the HF names, per architecture, so the family adapters (kvstate.families) plan the model
exactly as they plan the checkpoint. Every unreadable file or unknown architecture is one
KvstateError line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvstate.errors import KvstateError
from kvstate.gguf.fields import field, has_tensor, open_reader
from kvstate.gguf.hybrid_configs import falcon_h1, granitehybrid, jamba, kimi_linear, lfm2


def _qwen35(reader, arch: str) -> dict[str, Any]:
    """qwen35, qwen35moe and qwen3next (conversion/qwen.py: Qwen3_5TextModel, Qwen3_5MoeTextModel, Qwen3NextModel;
    llama.cpp runs every qwen3next layer as MoE: no `mlp_only_layers`, `decoder_sparse_step` 1)."""
    def get(key, default=None, required=True):
        value = field(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise KvstateError(f"{reader.source}: GGUF metadata has no {arch}.{key}")
        return value

    layers = get("block_count")
    head_dim = get("attention.key_length")
    recurrent = get("attention.recurrent_layers", required=False)
    if recurrent is None:  # older files: every `full_attention_interval`-th layer is attention
        interval = get("full_attention_interval", 4)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    cfg: dict[str, Any] = dict(
        model_type=MODEL_TYPES[arch],
        hidden_size=get("embedding_length"), num_hidden_layers=layers,
        num_attention_heads=get("attention.head_count"), num_key_value_heads=get("attention.head_count_kv"),
        head_dim=head_dim, rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=get("context_length"),
        linear_conv_kernel_dim=get("ssm.conv_kernel"), linear_key_head_dim=get("ssm.state_size"),
        linear_num_key_heads=get("ssm.group_count"), linear_num_value_heads=get("ssm.time_step_rank"),
        linear_value_head_dim=get("ssm.inner_size") // get("ssm.time_step_rank"),
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent[:layers]],
        rope_parameters=dict(rope_type="default", rope_theta=get("rope.freq_base"),
                             partial_rotary_factor=get("rope.dimension_count") / head_dim),
        hidden_act="silu", attention_bias=False, tie_word_embeddings=not has_tensor(reader, "output.weight"),
    )
    if arch == "qwen35":
        cfg["intermediate_size"] = get("feed_forward_length")
    else:
        cfg.update(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length"),
                   shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0))
    if arch == "qwen3next":
        cfg.update(intermediate_size=get("feed_forward_length", 0), decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


def _mamba2(reader, arch: str) -> dict[str, Any]:
    """mamba2 (conversion/mamba.py: Mamba2Model)."""
    def get(key):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise KvstateError(f"{reader.source}: GGUF metadata has no {arch}.{key}")
        return value

    hidden, inner, heads = get("embedding_length"), get("ssm.inner_size"), get("ssm.time_step_rank")
    return dict(model_type="mamba2", hidden_size=hidden, num_hidden_layers=get("block_count"),
                state_size=get("ssm.state_size"), expand=inner // hidden, n_groups=get("ssm.group_count"),
                num_heads=heads, head_dim=inner // heads, conv_kernel=get("ssm.conv_kernel"),
                layer_norm_epsilon=get("attention.layer_norm_rms_epsilon"),
                use_conv_bias=has_tensor(reader, "blk.0.ssm_conv1d.bias"),
                use_bias=has_tensor(reader, "blk.0.ssm_in.bias"),
                tie_word_embeddings=not has_tensor(reader, "output.weight"))


def _nemotron_h(reader, arch: str) -> dict[str, Any]:
    """nemotron_h and nemotron_h_moe (conversion/nemotron.py: NemotronHModel; a checkpoint whose config has
    MoE fields, as transformers writes every one, becomes nemotron_h_moe even without experts). Each
    block's kind is read from its tensors (the feed_forward_length array marks only the MoE blocks there).
    MoE blocks: relu^2 experts (up and down), a shared expert, an optional latent projection around them."""
    def get(key, default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise KvstateError(f"{reader.source}: GGUF metadata has no {arch}.{key}")
        return value

    layers = get("block_count")
    names = {t.name: t for t in reader.tensors}
    pattern = ""
    for i in range(layers):
        kind = ("M" if f"blk.{i}.ssm_in.weight" in names else "*" if f"blk.{i}.attn_q.weight" in names
                else "E" if f"blk.{i}.ffn_up_exps.weight" in names else "-" if f"blk.{i}.ffn_up.weight" in names
                else None)
        if kind is None:
            raise KvstateError(f"{reader.source}: block {i} has no mixer, MLP or MoE tensors (blk.{i}.ssm_in, attn_q, "
                               "ffn_up, ffn_up_exps)")
        pattern += kind
    inner, heads = get("ssm.inner_size"), get("ssm.time_step_rank")
    first = {k: pattern.index(k) for k in "M*-" if k in pattern}
    kv = get("attention.head_count_kv")
    eps = field(reader, f"{arch}.attention.layer_norm_rms_epsilon") or get("attention.layer_norm_epsilon")
    cfg = dict(model_type="nemotron_h", hybrid_override_pattern=pattern, num_hidden_layers=layers,
               hidden_size=get("embedding_length"), num_attention_heads=get("attention.head_count"),
               num_key_value_heads=max(kv) if isinstance(kv, list) else kv, head_dim=get("attention.key_length"),
               mamba_num_heads=heads, mamba_head_dim=inner // heads, ssm_state_size=get("ssm.state_size"),
               n_groups=get("ssm.group_count"), conv_kernel=get("ssm.conv_kernel"), layer_norm_epsilon=eps,
               max_position_embeddings=get("context_length"),
               tie_word_embeddings=not has_tensor(reader, "output.weight"))
    if "M" in first:
        cfg.update(use_conv_bias=f"blk.{first['M']}.ssm_conv1d.bias" in names,
                   use_bias=f"blk.{first['M']}.ssm_in.bias" in names)
    if "*" in first:
        cfg["attention_bias"] = f"blk.{first['*']}.attn_q.bias" in names
    if "-" in first:
        up = names[f"blk.{first['-']}.ffn_up.weight"]
        cfg.update(intermediate_size=int(up.shape[-1]), mlp_bias=f"blk.{first['-']}.ffn_up.bias" in names)
    if "E" in pattern:  # routing as llama.cpp runs it: sigmoid scores, its defaults where a key is absent
        cfg.update(n_routed_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
                   moe_intermediate_size=get("expert_feed_forward_length"),
                   moe_shared_expert_intermediate_size=get("expert_shared_feed_forward_length", 0),
                   moe_latent_size=get("moe_latent_size", 0), norm_topk_prob=get("expert_weights_norm", False),
                   routed_scaling_factor=get("expert_weights_scale", 1.0), n_group=get("expert_group_count", 1),
                   topk_group=get("expert_group_used_count", 1))
    return cfg


# GGUF architecture -> its config reader
ARCHITECTURES = {"qwen35": _qwen35, "qwen35moe": _qwen35, "qwen3next": _qwen35, "mamba2": _mamba2,
                 "nemotron_h": _nemotron_h, "nemotron_h_moe": _nemotron_h, "lfm2": lfm2, "falcon-h1": falcon_h1,
                 "granitehybrid": granitehybrid, "jamba": jamba, "kimi-linear": kimi_linear}
MODEL_TYPES = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text", "qwen3next": "qwen3_next"}


def vocab_size(reader) -> int:
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise KvstateError(f"{reader.source}: GGUF file has no tensor token_embd.weight")
    return int(embed.shape[-1])  # GGUF shapes are innermost first: [hidden, vocab]


def architecture(reader) -> str:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise KvstateError(f"{reader.source}: GGUF architecture {arch!r} is not supported "
                           f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def _readable(qtype) -> bool:
    """Whether kvstate reads tensors of `qtype`: a float type, or one gguf dequantizes (tried on one zero block)."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    if qtype.name in ("F32", "F16", "BF16"):
        return True
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
    except (NotImplementedError, KeyError):
        return False
    return True


def check_tensor_types(reader) -> None:
    """One KvstateError for the first tensor of a type kvstate cannot read (from the headers alone)."""
    verdicts: dict = {}
    for t in reader.tensors:
        if verdicts.setdefault(t.tensor_type, _readable(t.tensor_type)) is False:
            raise KvstateError(f"{reader.source}: tensor {t.name!r} has type {t.tensor_type.name}, which kvstate "
                               f"cannot read (supported: F32, F16, BF16 and the types gguf dequantizes)")


def matrix_dtype_name(reader, kept: frozenset[str] = frozenset()) -> str:
    """"bfloat16" when the file's matrices are mostly 16-bit or quantized (the loader holds them so), else
    "float32"; the matrices named in `kept` (held as blocks) do not count."""
    sizes = {"bfloat16": 0, "float32": 0}
    for t in reader.tensors:
        if len(t.shape) >= 2 and t.name not in kept:
            sizes["float32" if t.tensor_type.name == "F32" else "bfloat16"] += int(t.n_elements)
    return "bfloat16" if sizes["bfloat16"] > sizes["float32"] else "float32"


def config_of(reader) -> dict[str, Any]:
    """The HF config dict of an open reader (its tensor types checked: a file kvstate cannot run is refused
    before any plan is made of it)."""
    arch = architecture(reader)
    check_tensor_types(reader)
    cfg = ARCHITECTURES[arch](reader, arch)
    cfg["vocab_size"] = vocab_size(reader)
    cfg["_name_or_path"] = field(reader, "general.name") or Path(reader.source).stem
    cfg["gguf_architecture"] = arch
    cfg["dtype"] = matrix_dtype_name(reader)  # the model's dtype, as a checkpoint's config says it: the KV default
    cfg["gguf_tensor_bytes"] = sum(int(t.n_bytes) for t in reader.tensors)  # the weights as the file holds them
    for key, hf in (("tokenizer.ggml.eos_token_id", "eos_token_id"), ("tokenizer.ggml.bos_token_id", "bos_token_id")):
        if (value := field(reader, key)) is not None:
            cfg[hf] = value
    return cfg


def hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json dict of the GGUF file at `path`."""
    return config_of(open_reader(path))
