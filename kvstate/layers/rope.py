"""Rotary position embeddings (rotate-half form), full or partial, with default, linear and llama3 scaling.

The inverse frequencies follow transformers' `modeling_rope_utils` for the rope types we support;
an unsupported type is a clear error at build time rather than silently wrong positions.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvstate.errors import KvstateError
from kvstate.profiling import timed

SUPPORTED = ("default", "linear", "llama3")


def inv_frequencies(rotary_dim: int, theta: float, scaling: dict | None = None) -> torch.Tensor:
    """[rotary_dim // 2] inverse frequencies for the rope type in `scaling` (None: default)."""
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / (theta ** (steps / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind in ("default", "mrope"):
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled)
    raise KvstateError(f"rope type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")


class Rotary(nn.Module):
    """Applies RoPE to the first `rotary_dim` channels of each head of q and k ([T, H, D])."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, scaling: dict | None = None):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        # a plain attribute, not a buffer: computed on CPU even when the model is built on "meta"
        self.inv_freq = inv_frequencies(rotary_dim, theta, scaling)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, rotary_dim]
        return emb.cos(), emb.sin()

    @timed("rotary")
    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.cos_sin(positions)
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = (rot.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
