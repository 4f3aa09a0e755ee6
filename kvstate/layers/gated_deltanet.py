"""Gated DeltaNet token mixer (Qwen3.5, Qwen3-Next).

in_proj_qkv -> short causal conv (SiLU) -> q, k, v heads; beta = sigmoid(in_proj_b(x));
g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias); gated delta rule with L2-normed q, k;
gated RMSNorm with z = in_proj_z(x); out_proj. Prefill chunks use the chunk op over the packed
batch (cu_seqlens), decode steps the recurrent op; both carry the state in the layer's slots.
Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split into these four at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.layers._state import decode_pool, read_slots, short_conv, write_slots
from kvstate.layers.norm import GatedRMSNorm
from kvstate.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, *, eps: float = 1e-6, act: str = "silu"):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.act = act
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_kernel))  # depthwise, [D, W]
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "GatedDeltaNet":
        return cls(hidden_size, spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim,
                   spec.conv_kernel, eps=opts.norm_eps, **opts.for_mixer("gated_deltanet"))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.in_proj_qkv(x)  # [T, conv_dim]
        qkv = short_conv(qkv, cache.conv, batch, self.conv_weight, None, self.act)  # [T, D]
        decode = batch.decode_only

        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        beta = torch.sigmoid(self.in_proj_b(x).float())  # [T, HV]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        # decode: [N, 1, heads, dim] batches; prefill: one packed [1, T, heads, dim] with cu_seqlens
        shape = (t, 1) if decode else (1, t)
        q = q.reshape(*shape, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*shape, self.num_k_heads, self.head_k_dim)
        v = v.reshape(*shape, self.num_v_heads, self.head_v_dim)
        g, beta = g.reshape(*shape, -1), beta.reshape(*shape, -1)
        if decode:  # the slots' states [HV, K, V] are updated in place in the pool
            o, _ = recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                              **decode_pool(cache.state, batch))
        else:
            state = read_slots(cache.state, batch)  # [N, HV, K, V] fp32
            o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, cu_seqlens=batch.cu_seqlens)
            write_slots(cache.state, batch, state)

        z = self.in_proj_z(x).reshape(t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.reshape(t, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.reshape(t, self.value_dim))

    def cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        """Per-slot shapes: recurrent state [HV, K, V] and conv window [conv_dim, W]."""
        return {"state": (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                "conv": (self.conv_dim, self.conv_kernel)}
