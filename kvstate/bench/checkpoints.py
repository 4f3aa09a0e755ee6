"""Random checkpoints for the benchmarks, made with transformers' own classes (no hub access).

The issue's reference model: a ~0.5B Qwen3.5-style text model (hidden 1024, 24 layers of which 6
full attention, 16 linear heads of 128, 8 query / 2 KV heads of 256, vocab 32000). `--quick`
uses a small sibling of the same shape family.
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
}


def qwen3_5_checkpoint(size: str, directory: str | None = None, seed: int = 0):
    """Save a random Qwen3.5-style checkpoint; returns (path, the transformers model in fp32 eval mode)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    dims = SIZES[size]
    n = dims["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    config = Qwen3_5TextConfig(layer_types=layer_types, max_position_embeddings=32768, **dims)
    torch.manual_seed(seed)
    hf = Qwen3_5ForCausalLM(config).float().eval()
    path = Path(directory or tempfile.mkdtemp(prefix=f"kvstate-bench-{size}-"))
    hf.save_pretrained(path)
    return path, hf
