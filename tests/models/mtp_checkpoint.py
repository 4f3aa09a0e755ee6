"""Tiny checkpoints carrying random multi-token-prediction weights under the real checkpoints' names.

transformers neither builds nor saves `mtp.*` (it ignores them on load), so a test saves a tiny
model with save_pretrained, then writes what real Qwen3.5 / Qwen3-Next checkpoints add next to
the decoder: `mtp.fc.weight` [H, 2H], `mtp.pre_fc_norm_embedding.weight`, `mtp.pre_fc_norm_hidden.weight`,
`mtp.norm.weight` [H] and one full-attention decoder block `mtp.layers.0.*` (shaped as the
checkpoint's own full-attention block, MoE MLP and all), with `mtp_num_hidden_layers: 1` in config.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TINY_QWEN3_5 = dict(vocab_size=101, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=48, layer_types=["linear_attention", "full_attention"] * 2)


def add_mtp(path: Path, seed: int = 1, full_layer: int = 1) -> dict[str, torch.Tensor]:
    """Add random `mtp.*` tensors to the checkpoint in `path` (one model.safetensors); returns them."""
    path = Path(path)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    block = re.compile(rf"(?:model\.language_model\.|model\.)layers\.{full_layer}\.(.+)")
    hidden = tensors["model.embed_tokens.weight" if "model.embed_tokens.weight" in tensors
                     else "model.language_model.embed_tokens.weight"].shape[1]
    mtp = {}
    for key, t in tensors.items():
        m = block.fullmatch(key)
        if m:
            mtp[f"mtp.layers.0.{m[1]}"] = _random_like(t, m[1], g)
    mtp["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * torch.randn(hidden, generator=g)  # zero-centred: (1 + w)
    save_file({**tensors, **mtp}, str(file), metadata={"format": "pt"})
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = 1
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return mtp


def _random_like(t: torch.Tensor, name: str, g: torch.Generator) -> torch.Tensor:
    if t.dim() == 1:
        return (0.1 * torch.randn(t.shape, generator=g)).to(t.dtype)
    fan_in = t.shape[-1]
    return (torch.randn(t.shape, generator=g) / fan_in ** 0.5).to(t.dtype)
