"""Random checkpoints for the benchmarks, made with transformers' own classes (no hub access).

The issue's reference model: a ~0.5B Qwen3.5-style text model (hidden 1024, 24 layers of which 6
full attention, 16 linear heads of 128, 8 query / 2 KV heads of 256, vocab 32000). `--quick`
uses a small sibling of the same shape family. "0.8b" is Qwen/Qwen3.5-0.8B's own text config
(shared/reference/model-configs.md, verbatim: the 0.5b shapes plus its 248,320-token tied
vocabulary, rope theta 1e7 and 262,144 positions), saved in bf16 as the model ships: the model of
the walkthrough, for the GGUF comparisons with llama.cpp (`kvstate.bench.llama_cpp --size 0.8b`).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

SIZES = {
    "0.5b": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
                 linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=32000),
    "quick": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=32, linear_value_head_dim=32, vocab_size=4096),
    "0.8b": dict(attn_output_gate=True, dtype="bfloat16", full_attention_interval=4, head_dim=256, hidden_size=1024,
                 intermediate_size=3584, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_value_head_dim=128, mamba_ssm_dtype="float32",
                 max_position_embeddings=262144, num_attention_heads=8, num_hidden_layers=24, num_key_value_heads=2,
                 vocab_size=248320, tie_word_embeddings=True,
                 rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                                      mrope_interleaved=True, mrope_section=[11, 11, 10])),
}


def qwen3_5_checkpoint(size: str, directory: str | None = None, seed: int = 0):
    """Save a random Qwen3.5-style checkpoint (in its config's dtype, fp32 when it names none); returns
    (path, the transformers model in fp32 eval mode, holding the saved values)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    dims = SIZES[size]
    n = dims["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    config = Qwen3_5TextConfig(**{"layer_types": layer_types, "max_position_embeddings": 32768, **dims})
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(config).float().eval()
    path = Path(directory or tempfile.mkdtemp(prefix=f"kvstate-bench-{size}-"))
    hf.to(getattr(torch, dims.get("dtype", "float32"))).save_pretrained(path)
    return path, hf.float()


def add_random_mtp(directory, seed: int = 1) -> None:
    """Give a saved Qwen3.5-style checkpoint a random multi-token-prediction head under the real names
    (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, `mtp.layers.0.*` shaped as its last full-attention
    block) and `mtp_num_hidden_layers: 1`: what a wrong draft costs, measured on real shapes."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = Path(directory)
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    prefix, h = f"model.layers.{full}.", cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.startswith(prefix)]:
        t = tensors[key]
        tensors["mtp.layers.0." + key[len(prefix):]] = (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype)
    tensors["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.02
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{name}.weight"] = torch.zeros(h)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
