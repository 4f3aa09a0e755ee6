"""Mamba-1 (selective scan) token mixer, as Jamba runs it.

in_proj -> x, z; depthwise causal conv (with bias) + SiLU on x; x_proj -> dt (dt_rank), B, C,
each RMS-normed (Jamba's dt_layernorm / b_layernorm / c_layernorm); delta = dt_proj.weight @ dt
with dt_proj.bias and the softplus left to the scan (delta_bias, delta_softplus), exactly as
transformers' JambaMambaMixer calls mamba_ssm; A = -exp(A_log); y = scan(...) + D x, gated by
silu(z); out_proj. Prefill runs the chunk scan over the packed batch (cu_seqlens), decode the
recurrent scan on [N, 1, ...]; the conv window [d_inner, W] and the state [d_inner, d_state]
live in the layer's state slots.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.layers._state import read_slots, short_conv, write_slots
from kvstate.layers.norm import RMSNorm
from kvstate.ops import chunk_selective_scan, recurrent_selective_scan


class Mamba1(nn.Module):
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
        t = x.shape[0]
        u, z = self.in_proj(x).chunk(2, dim=-1)  # [T, d_inner] each
        u = short_conv(u, cache.conv, batch, self.conv_weight, self.conv_bias, self.act)  # [T, D]
        decode = batch.decode_only

        dt, B, C = self.x_proj(u).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.dt_layernorm is not None:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        delta = F.linear(dt, self.dt_proj.weight)  # [T, d_inner]; the bias goes to the scan as delta_bias
        A = -self.A_log.float().exp()  # [d_inner, d_state]
        # decode: [N, 1, ...] batches; prefill: one packed [1, T, ...] with cu_seqlens
        shape = (t, 1) if decode else (1, t)
        u, delta, z = (a.reshape(*shape, self.d_inner) for a in (u, delta, z))
        B, C = B.reshape(*shape, self.d_state), C.reshape(*shape, self.d_state)
        state = read_slots(cache.state, batch)  # [N, d_inner, d_state] fp32
        kwargs = dict(D=self.D.float(), z=z, delta_bias=self.dt_proj.bias.float(), delta_softplus=True,
                      initial_state=state, output_final_state=True)
        if decode:
            y, state = recurrent_selective_scan(u, delta, A, B, C, **kwargs)
        else:
            y, state = chunk_selective_scan(u, delta, A, B, C, cu_seqlens=batch.cu_seqlens, **kwargs)
        write_slots(cache.state, batch, state)
        return self.out_proj(y.reshape(t, self.d_inner))

    def cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes: recurrent state [d_inner, d_state] and conv window [d_inner, W]."""
        return {"state": (self.d_inner, self.d_state), "conv": (self.d_inner, self.conv_kernel)}
