"""Mamba-2 token mixer (pure Mamba-2 models, Nemotron-H).

in_proj -> [z (gate), xBC, dt]; short causal conv over xBC with SiLU; split into x (heads of
head_dim), B and C (n_groups x d_state); SSD scan with A = -exp(A_log), dt = softplus(dt + dt_bias)
and the D skip; gated grouped RMSNorm of y * silu(z) (one norm per group of d_inner / n_groups
channels; Falcon-H1: optional, or norm then gate, or no norm, y * silu(z)); out_proj. Falcon-H1
also scales in_proj's five output segments [z, x, B, C, dt] (`in_proj_scales`, its mup vector).
Prefill entries run `chunk_ssd`, decode entries `recurrent_ssd`
(`layers.recurrence`); the conv window [conv_dim, W] and the SSD state [H, d_state, head_dim]
live in the layer's state slots (transformers' cache holds the state's
transpose, [H, head_dim, d_state]).

dt clamping follows transformers (and mamba_ssm): the chunked scan clamps dt to `dt_limit`, the
one-token decode step does not. A checkpoint whose dt ever falls under the lower limit therefore
decodes slightly differently from a full forward, exactly as in the reference.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.layers.norm import GatedRMSNorm
from kvstate.layers.recurrence import RecurrentOps, recur, short_conv
from kvstate.ops import chunk_ssd, recurrent_ssd
from kvstate.ops.ssd import discretize

NO_LIMIT = (0.0, math.inf)
OPS = RecurrentOps(chunk_ssd, recurrent_ssd, chunk_positions=True)


class Mamba2(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, d_state: int, n_groups: int,
                 conv_kernel: int, *, eps: float = 1e-5, in_bias: bool = False, out_bias: bool = False,
                 conv_bias: bool = True, gated_norm: bool = True, norm_before_gate: bool = False,
                 dt_limit: tuple[float, float] = NO_LIMIT, act: str = "silu", chunk_size: int = 64,
                 in_proj_scales: tuple[float, ...] | None = None):
        super().__init__()
        if num_heads % n_groups:
            raise ValueError(f"n_groups ({n_groups}) must divide num_heads ({num_heads})")
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * d_state  # x, B, C share the short conv
        self.conv_kernel = conv_kernel
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.act = act
        self.chunk_size = chunk_size
        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + num_heads, bias=in_bias)  # z, xBC, dt
        self.in_proj_scales = None if in_proj_scales is None or all(m == 1 for m in in_proj_scales) \
            else tuple(float(m) for m in in_proj_scales)
        self._scale_vector = None  # [d_inner + conv_dim + H], made on first use from in_proj_scales
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))  # depthwise, [D, W]
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if conv_bias else None
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.d_inner, eps, norm_before_gate=norm_before_gate,
                                 group_size=self.d_inner // n_groups) if gated_norm else None
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=out_bias)

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "Mamba2":
        """Biases and the output norm as the spec says; opts.for_mixer("mamba2") may hold dt_limit, act,
        chunk_size, norm_before_gate, in_proj_scales."""
        return cls(hidden_size, spec.num_heads, spec.head_dim, spec.d_state, spec.n_groups, spec.conv_kernel,
                   eps=opts.norm_eps, in_bias=spec.in_proj_bias, out_bias=spec.out_proj_bias,
                   conv_bias=spec.conv_bias, gated_norm=spec.gated_norm, **opts.for_mixer("mamba2"))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj(x) [T, d_inner + conv_dim + H], each segment times its scale where the family has them."""
        out = self.in_proj(x)
        if self.in_proj_scales is None:
            return out
        if self._scale_vector is None or self._scale_vector.device != out.device:
            g = self.n_groups * self.d_state
            sizes = torch.tensor([self.d_inner, self.d_inner, g, g, self.num_heads])
            self._scale_vector = torch.tensor(self.in_proj_scales).repeat_interleave(sizes).to(out.device)
        return out * self._scale_vector

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """dt * A [T, H] (<= 0) for the layer's input x [T, hidden]: each head's state decays by its exp
        per token, with dt transformed as the prefill scan does it (bias, softplus, dt_limit)."""
        dt = self._project(x)[:, -self.num_heads:]  # [T, H]
        return discretize(dt, dt, -self.A_log.float().exp(), self.dt_bias, True, self.dt_limit)[1]

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t = x.shape[0]
        z, xbc, dt = self._project(x).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        xbc = short_conv(xbc, cache.conv, batch, self.conv_weight, self.conv_bias, self.act)  # [T, conv_dim]
        groups = self.n_groups * self.d_state
        xs, B, C = xbc.split([self.d_inner, groups, groups], dim=-1)
        tokens = dict(x=xs.reshape(t, self.num_heads, self.head_dim), dt=dt,
                      B=B.reshape(t, self.n_groups, self.d_state), C=C.reshape(t, self.n_groups, self.d_state))
        # no dt clamp on the decode step, as transformers' and mamba_ssm's step()
        y = recur(OPS, cache.state, batch, tokens, A=-self.A_log.float().exp(), D=self.D, dt_bias=self.dt_bias,
                  dt_softplus=True, prefill=dict(dt_limit=self.dt_limit, chunk_size=self.chunk_size))
        y = y.reshape(t, self.d_inner)
        y = y * F.silu(z.float()).to(y.dtype) if self.norm is None else self.norm(y, z)  # gate, grouped norm
        return self.out_proj(y)
