"""Kimi Delta Attention (KDA), the linear mixer of Kimi Linear.

q, k, v projections (held as one fused [3 * H * D, hidden] weight: one GEMM) -> one short causal
conv (SiLU) over the 3 * H * D channels (the checkpoint's q_conv1d / k_conv1d / v_conv1d are its
row blocks, so the conv state is one [3 * H * D, W] window per slot, as the cache spec counts it);
per-channel log-decay g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias) [T, H, D];
beta = sigmoid(b_proj(x)); the KDA recurrence with L2-normed q, k; output norm
w * rmsnorm(o) * sigmoid(g_b(g_a(x))) per head (Kimi gates with a sigmoid, not SiLU); o_proj.
Prefill entries run chunk_kda, decode entries recurrent_kda (`layers.recurrence`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.kernels.fused import project
from kvstate.layers.norm import GatedRMSNorm
from kvstate.layers.recurrence import RecurrentOps, recur, short_conv
from kvstate.ops import chunk_kda, recurrent_kda

OPS = RecurrentOps(chunk_kda, recurrent_kda, chunk_positions=True)


class KimiDeltaAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, conv_kernel: int, *,
                 eps: float = 1e-6, act: str = "silu"):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.dim = num_heads * head_dim  # width of each of q, k, v
        self.conv_kernel = conv_kernel
        self.act = act
        self.qkv_proj = nn.Linear(hidden_size, 3 * self.dim, bias=False)  # rows: q, k, v
        self.conv_weight = nn.Parameter(torch.empty(3 * self.dim, conv_kernel))  # depthwise, [3HD, W]
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)  # low-rank forget gate
        self.f_b_proj = nn.Linear(head_dim, self.dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)  # low-rank output gate
        self.g_b_proj = nn.Linear(head_dim, self.dim, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, eps, activation="sigmoid")
        self.o_proj = nn.Linear(self.dim, hidden_size, bias=False)

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "KimiDeltaAttention":
        return cls(hidden_size, spec.num_heads, spec.head_dim, spec.conv_kernel, eps=opts.norm_eps,
                   **opts.for_mixer("kda"))

    def decay_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [T, H, D] (<= 0) from the low-rank forget gate's f_a_proj(x) [T, D]."""
        gate_in = self.f_b_proj(f_a).float() + self.dt_bias.float()  # [T, HD]
        return -self.A_log.float().exp()[:, None] * F.softplus(gate_in.view(-1, self.num_heads, self.head_dim))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [T, H, D] for the layer's input x [T, hidden]: each key channel of each head's state
        decays by exp(g) per token (KDA's decay is per channel, not per head)."""
        return self.decay_gate(self.f_a_proj(x))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv, f_a, b, g_a = project(x, self.qkv_proj, self.f_a_proj, self.b_proj, self.g_a_proj)  # one call if fused
        qkv = short_conv(qkv, cache.conv, batch, self.conv_weight, None, self.act)  # [T, 3HD]
        q, k, v = (part.view(t, h, d) for part in qkv.split(self.dim, dim=-1))
        g = self.decay_gate(f_a)  # [T, H, D]
        beta = torch.sigmoid(b.float())  # [T, H]
        o = recur(OPS, cache.state, batch, dict(q=q, k=k, v=v, g=g, beta=beta),
                  use_qk_l2norm_in_kernel=True)  # [T, H, D]; state [H, D, D]
        gate = self.g_b_proj(g_a).view(t, h, d)
        o = self.o_norm(o.reshape(t, h, d), gate)
        return self.o_proj(o.reshape(t, self.dim))
