"""RMSNorm variants used by the hybrid families, computed in fp32.

- `RMSNorm(offset=0)`: y = w * x / rms(x) (Llama, Jamba, Nemotron-H, Kimi).
- `RMSNorm(offset=1)`: y = (1 + w) * x / rms(x), weights stored zero-centred (Qwen3.5, Qwen3-Next).
- `GatedRMSNorm`: the output norm of linear mixers, with a gate z: norm-then-gate
  (Qwen's GDN: w * norm(x) * silu(z)) or gate-then-norm over groups (Mamba-2 / Nemotron-H:
  w * norm_g(x * silu(z))).
Decode-sized fp32 inputs go through the compiled kernels (`kernels.decode`) when they serve them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.kernels import decode as kdecode
from kvstate.profiling import timed


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    @timed("norm")
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = kdecode.rms_norm(x, self.weight, self.eps, self.offset)
        if y is not None:
            return y
        w = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (rms_normalize(x, self.eps) * w).to(x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual add and this norm, as one kernel call when served."""
        out = kdecode.add_rms_norm(x, delta, self.weight, self.eps, self.offset)
        if out is not None:
            return out
        x = x + delta
        return x, self(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


_GATES = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, norm_before_gate: bool = True,
                 group_size: int | None = None, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size or dim
        self.activation = activation
        self.act = _GATES[activation]
        self.weight = nn.Parameter(torch.ones(dim))

    @timed("norm")
    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.norm_before_gate and self.activation == "silu" and self.group_size == x.shape[-1]:
            y = kdecode.gated_rms_norm(x, gate, self.weight, self.eps)
            if y is not None:
                return y
        dtype = x.dtype
        x, gate = x.float(), gate.float()
        if not self.norm_before_gate:
            x = x * self.act(gate)
        shape = x.shape
        x = rms_normalize(x.reshape(*shape[:-1], -1, self.group_size), self.eps).reshape(shape)
        x = x * self.weight.float()
        if self.norm_before_gate:
            x = x * self.act(gate)
        return x.to(dtype)
