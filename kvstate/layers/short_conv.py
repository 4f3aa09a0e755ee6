"""The gated short convolution (LFM2's conv layers): no recurrent state, only a conv window.

in_proj -> [B, C, x] (each `dim` channels); the depthwise causal conv (no activation) runs over
B * x; the output is out_proj(C * conv(B * x)). The conv window [dim, W] (or W - 1 columns) lives in
the layer's state slots and runs through the one short-conv path of the linear mixers
(`layers.recurrence.short_conv`: decode, prefill, verify with rollback, prefix-cache captures).
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.layers.recurrence import short_conv


class ShortConv(nn.Module):
    def __init__(self, hidden_size: int, dim: int, kernel: int, *, bias: bool = False):
        super().__init__()
        self.dim, self.kernel = dim, kernel
        self.in_proj = nn.Linear(hidden_size, 3 * dim, bias=bias)  # B, C, x
        self.conv_weight = nn.Parameter(torch.empty(dim, kernel))  # depthwise, [D, W]
        self.conv_bias = nn.Parameter(torch.zeros(dim)) if bias else None
        self.out_proj = nn.Linear(dim, hidden_size, bias=bias)

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "ShortConv":
        return cls(hidden_size, spec.dim, spec.kernel, bias=spec.bias)

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        b, c, h = self.in_proj(x).chunk(3, dim=-1)  # [T, D] each
        y = short_conv((b * h).contiguous(), cache.conv, batch, self.conv_weight, self.conv_bias, None)  # [T, D]
        return self.out_proj(c * y)
