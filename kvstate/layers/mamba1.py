"""Mamba-1 (selective scan) token mixer, as Jamba runs it.

in_proj -> x, z; depthwise causal conv (with bias) + SiLU on x; x_proj -> dt (dt_rank), B, C,
each RMS-normed (Jamba's dt_layernorm / b_layernorm / c_layernorm); delta = dt_proj.weight @ dt
with dt_proj.bias and the softplus left to the scan (delta_bias, delta_softplus), exactly as
transformers' JambaMambaMixer calls mamba_ssm; A = -exp(A_log); y = scan(...) + D x, gated by
silu(z); out_proj. Prefill entries run the chunk scan, decode entries the recurrent scan
(`layers.recurrence`); the conv window [d_inner, W] and the state [d_inner, d_state] live in
the layer's state slots.
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.kernels import linear
from kvstate.layers.norm import RMSNorm
from kvstate.layers.recurrence import RecurrentOps, recur, short_conv
from kvstate.ops import chunk_selective_scan, recurrent_selective_scan

OPS = RecurrentOps(chunk_selective_scan, recurrent_selective_scan)


class Mamba1(nn.Module):
    weight_read = ("dt_proj",)  # projections read as a tensor, not called (kernels.quant keeps them)

    def __init__(self, hidden_size: int, d_inner: int, d_state: int, conv_kernel: int, dt_rank: int, *,
                 eps: float = 1e-6, conv_bias: bool = True, proj_bias: bool = False, inner_norms: bool = True,
                 act: str = "silu"):
        """inner_norms: Jamba's RMSNorms on dt, B and C (plain Mamba has none)."""
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank = d_inner, d_state, dt_rank
        self.conv_kernel = conv_kernel
        self.act = act
        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(d_inner, conv_kernel))  # depthwise, [D, W]
        self.conv_bias = nn.Parameter(torch.zeros(d_inner)) if conv_bias else None
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias)
        if inner_norms:
            self.dt_layernorm = RMSNorm(dt_rank, eps)
            self.b_layernorm = RMSNorm(d_state, eps)
            self.c_layernorm = RMSNorm(d_state, eps)
        else:
            self.dt_layernorm = self.b_layernorm = self.c_layernorm = None

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "Mamba1":
        return cls(hidden_size, spec.d_inner, spec.d_state, spec.conv_kernel, spec.dt_rank, eps=opts.norm_eps,
                   **opts.for_mixer("mamba1"))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [T, d_inner] each
        u = short_conv(u, cache.conv, batch, self.conv_weight, self.conv_bias, self.act)  # [T, d_inner]
        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        delta = linear(dt, self.dt_proj.weight)  # [T, d_inner]; the bias goes to the scan as delta_bias
        y = recur(OPS, cache.state, batch, dict(u=u, delta=delta, B=B, C=C, z=z), A=-self.A_log.float().exp(),
                  D=self.D.float(), delta_bias=self.dt_proj.bias.float(), delta_softplus=True)  # [T, d_inner]
        return self.out_proj(y)
