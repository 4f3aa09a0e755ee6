"""Feed-forward blocks: the gated MLP (SwiGLU and friends) and the plain MLP (Nemotron-H's relu^2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.errors import KvstateError
from kvstate.kernels import decode as kdecode
from kvstate.kernels.fused import project

ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda x: torch.square(F.relu(x)),
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise KvstateError(f"activation {name!r} is not supported ({', '.join(ACTIVATIONS)})") from None


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)); `scales` multiply gate(x) and down's output (Falcon-H1's mlp_multipliers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False,
                 scales: tuple[float, float] = (1.0, 1.0)):
        super().__init__()
        self.gate_scale, self.down_scale = scales
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)  # one kernel call when fused
        if self.gate_scale != 1:
            gate = gate * self.gate_scale
        h = kdecode.silu_mul(gate, up) if self.act is F.silu else None  # decode-sized: one kernel call
        out = self.down_proj(self.act(gate) * up if h is None else h)
        return out if self.down_scale == 1 else out * self.down_scale


class MLP(nn.Module):
    """down(act(up(x))), no gate (Nemotron-H)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "relu2", bias: bool = False):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
