"""A freshly initialised Qwen3.5 text checkpoint (config.json + model.safetensors), written without transformers.

`kvstate recall train-default` starts from this: it writes the checkpoint, loads it with
kvstate's loader (so the model knows its checkpoint layout and can be saved back in it), trains
it, and saves it. The tensor names and shapes are transformers' Qwen3_5ForCausalLM's
(`model_type` "qwen3_5_text"); a test loads the result in transformers. Initialisation follows
transformers' where it matters for training from scratch: zero-centred norms at 0 (Qwen adds 1),
the gated output norm of the Gated DeltaNet at 1, A_log = log U(1, 16). One departure: dt_bias is
Mamba's (softplus(dt_bias) log-uniform in [1e-3, 0.1]), not transformers' 1: with dt_bias = 1 every
head's decay per token, exp(-A softplus(1)), is at most 0.27, so the state forgets within a few
tokens and a tiny model never learns to carry a name to its answer (measured: hybrid and linear
models stuck at the same loss, no exact answer after 275 steps). Matrices are N(0, 1 / fan_in),
output projections further scaled by 1 / sqrt(2 * layers).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file


def qwen3_5_config(*, vocab_size: int, hidden_size: int, layers: str, intermediate_size: int, heads: int,
                   kv_heads: int, head_dim: int, linear_heads: int, linear_head_dim: int, eos_token_id: int,
                   pad_token_id: int, max_position_embeddings: int = 4096, tie_word_embeddings: bool = False) -> dict:
    """config.json of a Qwen3.5 text model; `layers` reads like the planner's layer string ("GGGA":
    G a Gated DeltaNet layer, A full attention)."""
    if set(layers) - {"G", "A"}:
        raise ValueError(f"layers: only G and A, got {layers!r}")
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": vocab_size,
        "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": len(layers),
        "layer_types": ["full_attention" if c == "A" else "linear_attention" for c in layers],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "linear_num_key_heads": linear_heads, "linear_num_value_heads": linear_heads,
        "linear_key_head_dim": linear_head_dim, "linear_value_head_dim": linear_head_dim,
        "linear_conv_kernel_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": eos_token_id, "pad_token_id": pad_token_id, "bos_token_id": None, "dtype": "float32",
        "transformers_version": "5.0.0",
    }


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor of transformers' Qwen3_5ForCausalLM for `cfg`, name -> shape."""
    h, v, f = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    conv_dim = 2 * nk * dk + nv * dv  # q, k and v channels share the short conv
    shapes = {"model.embed_tokens.weight": (v, h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            shapes.update({p + "linear_attn.in_proj_qkv.weight": (conv_dim, h),
                           p + "linear_attn.in_proj_z.weight": (nv * dv, h),
                           p + "linear_attn.in_proj_b.weight": (nv, h), p + "linear_attn.in_proj_a.weight": (nv, h),
                           p + "linear_attn.conv1d.weight": (conv_dim, 1, cfg["linear_conv_kernel_dim"]),
                           p + "linear_attn.A_log": (nv,), p + "linear_attn.dt_bias": (nv,),
                           p + "linear_attn.norm.weight": (dv,), p + "linear_attn.out_proj.weight": (h, nv * dv)})
        else:  # q_proj also gives the output gate: 2 * heads * head_dim rows
            shapes.update({p + "self_attn.q_proj.weight": (2 * heads * hd, h),
                           p + "self_attn.k_proj.weight": (kv * hd, h),
                           p + "self_attn.v_proj.weight": (kv * hd, h), p + "self_attn.o_proj.weight": (h, heads * hd),
                           p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
        shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                       p + "mlp.down_proj.weight": (h, f),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings"):
        shapes["lm_head.weight"] = (v, h)
    return shapes


def init_tensor(name: str, shape: tuple[int, ...], num_layers: int, g: torch.Generator, *,
                tied: bool = False) -> torch.Tensor:
    if name.endswith("A_log"):
        return torch.log(1 + 15 * torch.rand(shape, generator=g))
    if name.endswith("dt_bias"):  # softplus(dt_bias) = dt, log-uniform in [1e-3, 1e-1] (Mamba's init)
        dt = torch.exp(math.log(1e-3) + torch.rand(shape, generator=g) * (math.log(1e-1) - math.log(1e-3)))
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if name.endswith("norm.weight"):
        return torch.zeros(shape)  # Qwen's zero-centred RMSNorm multiplies by (1 + w)
    if name.endswith("conv1d.weight"):
        return (torch.rand(shape, generator=g) * 2 - 1) / math.sqrt(shape[-1])  # torch's Conv1d default bound
    if name == "model.embed_tokens.weight":  # also the LM head when tied: logits of unit scale
        return torch.randn(shape, generator=g) * (shape[1] ** -0.5 if tied else 1.0)
    std = shape[1] ** -0.5
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * num_layers)
    return torch.randn(shape, generator=g) * std


def write_initial_checkpoint(cfg: dict, path: str | Path, *, seed: int) -> Path:
    """config.json and freshly initialised model.safetensors in `path` (deterministic in `seed`)."""
    g = torch.Generator().manual_seed(seed)
    tied = bool(cfg.get("tie_word_embeddings"))
    tensors = {name: init_tensor(name, shape, cfg["num_hidden_layers"], g, tied=tied).contiguous()
               for name, shape in tensor_shapes(cfg).items()}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
