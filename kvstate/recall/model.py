"""The tiny recall model: embedding, one block per letter of the layer pattern (pre-norm mixer
and gated MLP, each residual), final norm, LM head; logits only at the rows that are scored.

`RecallModel("GA", ...)` is a Gated DeltaNet layer then an attention layer. The model runs padded
[B, T] token ids (every MQAR example has the same length) and returns logits [R, vocab] at the R
flat positions asked for, so training pays the LM head only where the loss is taken.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.errors import KvstateError
from kvstate.layers.mlp import GatedMLP
from kvstate.layers.norm import RMSNorm
from kvstate.recall.mixers import KINDS, MixerSize, Packed, make_mixer


class Block(nn.Module):
    def __init__(self, kind: str, size: MixerSize):
        super().__init__()
        self.mixer_norm, self.mlp_norm = RMSNorm(size.width), RMSNorm(size.width)
        self.mixer = make_mixer(kind, size)
        self.mlp = GatedMLP(size.width, 2 * size.width)

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x), p)
        return x + self.mlp(self.mlp_norm(x))


class RecallModel(nn.Module):
    def __init__(self, layers: str, vocab_size: int, width: int, *, heads: int = 1, key_dim: int | None = None,
                 conv: bool = True):
        super().__init__()
        bad = [c for c in layers if c not in KINDS]
        if not layers or bad:
            letters = ", ".join(f"{k} ({v})" for k, v in KINDS.items())
            raise KvstateError(f"layer pattern {layers!r}: use the letters {letters}")
        if width < 1 or heads < 1 or width % heads:
            raise KvstateError(f"width {width} must be a positive multiple of heads {heads}")
        self.layers = layers
        self.size = MixerSize(width, heads, key_dim or width // heads, conv)
        if self.size.key_dim < 1:
            raise KvstateError(f"key dim must be positive, got {self.size.key_dim}")
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(kind, self.size) for kind in layers)
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def state_numbers(self) -> list[int]:
        """Fixed-state numbers per layer for one sequence (0 for attention layers)."""
        return [self.size.state_numbers(kind) for kind in self.layers]

    def forward(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """ids [B, T] -> logits [R, vocab] at flat positions `rows` [R] (b * T + t), or [B, T, vocab]."""
        b, t = ids.shape
        p = Packed.of(b, t, device=ids.device)
        x = self.embed(ids)  # [B, T, W]
        for block in self.blocks:
            x = block(x, p)
        x = self.norm(x)
        if rows is None:
            return self.head(x)
        return self.head(x.reshape(b * t, -1).index_select(0, rows))
