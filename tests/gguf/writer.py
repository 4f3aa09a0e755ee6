"""GGUF files written in the tests as llama.cpp's converter writes them (conversion/lfm2.py, falcon_h1.py,
granite.py, mamba.py, jamba.py), with gguf's own GGUFWriter, its `add_*` keys and its tensor name map, so no test
depends on a llama.cpp source tree. Checked once by hand against the converter's own files of the same
checkpoints (same keys, names, shapes and bytes).

`write_gguf(ckpt, out)`: a transformers checkpoint folder (config.json, model.safetensors, a byte-level
BPE tokenizer.json; Jamba: a SentencePiece-style BPE one) -> the GGUF file, F32. (Jamba's converter was not
run by hand: it asks for a tokenizer.model or a llama-style tokenizer.json; the keys, names and transforms
here are read from conversion/jamba.py.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from gguf import (MODEL_ARCH, MODEL_ARCH_NAMES, MODEL_TENSOR, TENSOR_NAMES, GGMLQuantizationType, GGUFWriter,
                  get_tensor_name_map)
from gguf.quants import quantize
from safetensors.torch import load_file, save_file

from tests.gguf.writer_kimi import kimi_keys, kimi_tensors


def _text_keys(w: GGUFWriter, c: dict, context: bool = True) -> None:
    """What TextModel.set_gguf_parameters writes beside the block count, width and head count."""
    if context:
        w.add_context_length(c["max_position_embeddings"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_vocab_size(c["vocab_size"])


def _each(transform):
    """A whole-checkpoint transform from one that takes a tensor at a time."""
    return lambda c, tensors: (out for name, t in tensors.items() for out in transform(c, name, t))


def _lfm2_keys(w: GGUFWriter, c: dict) -> None:
    """LFM2Model.set_gguf_parameters: KV heads per layer (0 on conv layers), the auto-adjusted MLP width."""
    _text_keys(w, c)
    w.add_head_count_kv([c["num_key_value_heads"] if t != "conv" else 0 for t in c["layer_types"]])
    ff = int(2 * c["intermediate_size"] / 3) if c["block_auto_adjust_ff_dim"] else c["intermediate_size"]
    ff = int((c.get("block_ffn_dim_multiplier") or 1.0) * ff) if c["block_auto_adjust_ff_dim"] else ff
    if c["block_auto_adjust_ff_dim"]:
        ff = c["block_multiple_of"] * ((ff + c["block_multiple_of"] - 1) // c["block_multiple_of"])
    w.add_feed_forward_length(ff)
    w.add_shortconv_l_cache(c["conv_L_cache"])
    w.add_layer_norm_rms_eps(c["norm_eps"])


def _lfm2_tensor(c: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.squeeze(1) if "conv.conv" in name else t)]


def _mamba2_keys(w: GGUFWriter, c: dict, inner: int, heads: int) -> None:
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(c["mamba_n_groups"])


def _mamba2_tensor(c: dict, name: str, t: torch.Tensor, inner: int) -> torch.Tensor:
    """Mamba2Model.modify_tensors: conv squeezed, A and D as [heads, 1], A = -exp(A_log), the norm grouped."""
    if "conv1d.weight" in name:
        t = t.squeeze()
    elif name.endswith((".A_log", ".D")):
        t = t.reshape(*t.shape, 1)
    elif name.endswith("mamba.norm.weight"):
        t = t.reshape(c["mamba_n_groups"], inner // c["mamba_n_groups"])
    return -torch.exp(t) if name.endswith(".A_log") else t


def _falcon_h1_keys(w: GGUFWriter, c: dict) -> None:
    _text_keys(w, c)
    w.add_head_count_kv(c["num_key_value_heads"])
    _mamba2_keys(w, c, c["mamba_d_ssm"], c["mamba_d_ssm"] // c["mamba_d_head"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def _falcon_h1_tensor(c: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """FalconH1Model.modify_tensors: each muP multiplier multiplied into the weight (biases too)."""
    t = _mamba2_tensor(c, name, t, c["mamba_d_ssm"]).clone()
    attn_in, mlp = c["attention_in_multiplier"], c["mlp_multipliers"]
    scale = {"down_proj": mlp[1], "gate_proj": mlp[0], "k_proj": c["key_multiplier"] * attn_in, "q_proj": attn_in,
             "v_proj": attn_in, "o_proj": c["attention_out_multiplier"], "out_proj": c["ssm_out_multiplier"],
             "lm_head": c["lm_head_multiplier"], "embed_tokens": c["embedding_multiplier"]}
    hit = next((k for k in scale if k in name), None)
    if hit is not None:
        t = t * scale[hit]
    elif "in_proj" in name:
        d, gs = c["mamba_d_ssm"], c["mamba_n_groups"] * c["mamba_d_state"]
        t = t * c["ssm_in_multiplier"]
        for (lo, hi), m in zip(((0, d), (d, 2 * d), (2 * d, 2 * d + gs), (2 * d + gs, 2 * d + 2 * gs),
                                (2 * d + 2 * gs, t.shape[0])), c["ssm_multipliers"]):
            t[lo:hi] *= m
    return [(name, t)]


def _granite_keys(w: GGUFWriter, c: dict) -> None:
    """GraniteHybridModel.set_gguf_parameters (through GraniteModel and GraniteMoeModel's)."""
    _text_keys(w, c, context=False)
    attn = [t in ("attention", "full_attention") for t in c["layer_types"]]
    inner = c["mamba_expand"] * c["hidden_size"]
    _mamba2_keys(w, c, inner, c["mamba_n_heads"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count_kv([c["num_key_value_heads"] if a else 0 for a in attn])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("num_local_experts"):
        w.add_expert_count(c["num_local_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
    w.add_attention_scale(c["attention_multiplier"])
    w.add_embedding_scale(c["embedding_multiplier"])
    w.add_residual_scale(c["residual_multiplier"])
    w.add_logit_scale(c["logits_scaling"])
    w.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    w.add_rope_scaling_finetuned(False)  # no RoPE: the converter's `use_rope` is for Bamba only
    w.add_context_length(2**20)


def _granite_tensor(c: dict, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """GraniteMoeModel.modify_tensors: the fused gate|up of the experts and the shared MLP split in two
    (the shared MLP named as the plain MLP when there are no experts). Only the plan is read from these
    files (kvstate builds no Granite model), so the attention rows keep their order."""
    bid = name.split(".")[2] if ".layers." in name else None
    tensor = lambda kind: TENSOR_NAMES[kind].format(bid=bid) + ".weight"  # noqa: E731
    experts = bool(c.get("num_local_experts"))
    if name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = t.split(c["intermediate_size"], dim=-2)
        return [(tensor(MODEL_TENSOR.FFN_GATE_EXP), gate), (tensor(MODEL_TENSOR.FFN_UP_EXP), up)]
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.split(c["shared_intermediate_size"], dim=-2)
        kinds = (MODEL_TENSOR.FFN_GATE_SHEXP, MODEL_TENSOR.FFN_UP_SHEXP) if experts else \
            (MODEL_TENSOR.FFN_GATE, MODEL_TENSOR.FFN_UP)
        return [(tensor(kinds[0]), gate), (tensor(kinds[1]), up)]
    if name.endswith("shared_mlp.output_linear.weight"):
        return [(tensor(MODEL_TENSOR.FFN_DOWN_SHEXP if experts else MODEL_TENSOR.FFN_DOWN), t)]
    return [(name, _mamba2_tensor(c, name, t, c["mamba_expand"] * c["hidden_size"]))]


def _jamba_keys(w: GGUFWriter, c: dict) -> None:
    """JambaModel.set_gguf_parameters: KV heads per layer, 0 but on attention layers."""
    period, offset, n = c["attn_layer_period"], c["attn_layer_offset"], c["num_hidden_layers"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count_kv([c["num_key_value_heads"] if i >= offset and (i - offset) % period == 0 else 0
                         for i in range(n)])
    w.add_ssm_conv_kernel(c["mamba_d_conv"])
    w.add_ssm_inner_size(c["mamba_expand"] * c["hidden_size"])
    w.add_ssm_state_size(c["mamba_d_state"])
    w.add_ssm_time_step_rank(c["mamba_dt_rank"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])


def _jamba_tensors(c: dict, tensors: dict):
    """JambaModel.modify_tensors: each MoE layer's experts stacked into one [experts, out, in] tensor per
    projection (named as Qwen2-MoE's), conv squeezed, A = -exp(A_log)."""
    experts: dict[tuple[str, str], list] = {}
    for name, t in tensors.items():
        if ".feed_forward.experts." in name:
            _, _, bid, _, _, e, wid, _ = name.split(".")
            experts.setdefault((bid, wid), [None] * c["num_experts"])[int(e)] = t
            continue
        if "conv1d.weight" in name:
            t = t.squeeze()
        yield name, -torch.exp(t) if name.endswith(".A_log") else t
    for (bid, wid), parts in experts.items():
        yield f"model.layers.{bid}.mlp.experts.{wid}.weight", torch.stack(parts)


# model_type -> (GGUF architecture, its keys, its tensor transform)
FAMILIES = {"jamba": (MODEL_ARCH.JAMBA, _jamba_keys, _jamba_tensors),
            "kimi_linear": (MODEL_ARCH.KIMI_LINEAR, kimi_keys, kimi_tensors),
            "lfm2": (MODEL_ARCH.LFM2, _lfm2_keys, _each(_lfm2_tensor)),
            "falcon_h1": (MODEL_ARCH.FALCON_H1, _falcon_h1_keys, _each(_falcon_h1_tensor)),
            "granitemoehybrid": (MODEL_ARCH.GRANITE_HYBRID, _granite_keys, _each(_granite_tensor))}


def _tokenizer(w: GGUFWriter, ckpt: Path) -> None:
    """A byte-level BPE tokenizer.json as the converter's `_set_vocab_gpt2` stores it."""
    tok = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = {**tok["model"]["vocab"], **{a["content"]: a["id"] for a in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    config = json.loads((ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    if "eos_token" in config:
        w.add_eos_token_id(vocab[config["eos_token"]])
    template = ckpt / "chat_template.jinja"  # where transformers 5 saves it
    if "chat_template" in config or template.is_file():
        w.add_chat_template(config.get("chat_template") or template.read_text(encoding="utf-8"))


def _spm_tokenizer(w: GGUFWriter, ckpt: Path) -> None:
    """A SentencePiece BPE tokenizer.json as the converter's `_set_vocab_sentencepiece` stores its pieces:
    scores that rank the merges (a piece made by an earlier merge scores higher), token types (unknown,
    control, byte <0xNN>, normal)."""
    tok = json.loads((ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    kinds = [2 if t == tok["model"]["unk_token"] else 3 if t in special else
             6 if re.fullmatch(r"<0x[0-9A-F]{2}>", t) else 1 for t in tokens]
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([-float(i) if k == 1 else 0.0 for i, k in enumerate(kinds)])
    w.add_token_types(kinds)
    w.add_unk_token_id(vocab[tok["model"]["unk_token"]])
    config = json.loads((ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    w.add_bos_token_id(vocab[config["bos_token"]])
    w.add_eos_token_id(vocab[config["eos_token"]])


# what the converter's --outtype bf16 keeps F32 (TextModel.prepare_tensors): 1-D tensors, norms, names not
# ending in .weight (A, D, biases), routers and conv kernels
_F32 = re.compile(r".*(_norm\.weight|ffn_gate_inp(_shexp)?\.weight|conv1d(_[qkv])?\.weight|shortconv\.conv\.weight)")


def _add(w: GGUFWriter, name: str, data: torch.Tensor, bf16: bool) -> None:
    values = np.ascontiguousarray(data.numpy(), dtype=np.float32)
    if bf16 and values.ndim > 1 and name.endswith(".weight") and not _F32.fullmatch(name):
        w.add_tensor(name, quantize(values, GGMLQuantizationType.BF16), raw_dtype=GGMLQuantizationType.BF16)
    else:
        w.add_tensor(name, values)


def write_gguf(ckpt: Path, out: Path, bf16: bool = False) -> Path:
    """`bf16`: the matrices stored BF16, as the converter's --outtype bf16 does (else every tensor F32)."""
    c = json.loads((ckpt / "config.json").read_text())
    arch, keys, transform = FAMILIES[c["model_type"]]
    w = GGUFWriter(str(out), MODEL_ARCH_NAMES[arch])
    w.add_block_count(c["num_hidden_layers"])
    w.add_embedding_length(c["hidden_size"])
    w.add_head_count(c["num_attention_heads"])
    keys(w, c)
    if (ckpt / "tokenizer.json").is_file():
        (_spm_tokenizer if c["model_type"] == "jamba" else _tokenizer)(w, ckpt)
    names = get_tensor_name_map(arch, c["num_hidden_layers"])
    tensors = {k: t.float() for k, t in load_file(str(ckpt / "model.safetensors")).items()}
    for name, data in transform(c, tensors):
        if name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors (and Kimi Linear's modify_tensors)
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        gguf_name = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        _add(w, gguf_name, data, bf16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def bf16_checkpoint(ckpt: Path, dst: Path) -> Path:
    """The checkpoint in bf16 (as a bf16 model saves it)."""
    shutil.copytree(ckpt, dst)
    tensors = {k: t.to(torch.bfloat16).contiguous() for k, t in load_file(str(ckpt / "model.safetensors")).items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return dst
