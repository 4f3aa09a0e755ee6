"""Gated DeltaNet token mixer (Qwen3.5, Qwen3-Next).

in_proj_qkv -> short causal conv (SiLU) -> q, k, v heads; beta = sigmoid(in_proj_b(x));
g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias); gated delta rule with L2-normed q, k;
gated RMSNorm with z = in_proj_z(x); out_proj. The conv window [conv_dim, W] and the state
[HV, K, V] live in the layer's state slots; `layers.recurrence` runs prefill and decode entries.
A decode-only step runs everything between the projections as one compiled kernel per layer
(`kernels.decode.gdn_decode`) when it serves the call, a step of decode and verify entries
(speculative decoding) its per-token form `gdn_verify`, which keeps the state after every token
for the rollback; otherwise the ops below, each of which may
still use its own kernel (gates, conv step, recurrent step, norm).
Qwen3-Next's fused in_proj_qkvz / in_proj_ba are split into these four at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.kernels import decode as kdecode
from kvstate.kernels.fused import project
from kvstate.layers.norm import GatedRMSNorm
from kvstate.layers.recurrence import RecurrentOps, clear_fresh, recur, short_conv
from kvstate.ops import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _recurrent(q, k, v, g, beta, *, initial_state=None, state_indices=None, inplace_final_state=False,
               use_qk_l2norm_in_kernel=False, scale=None, **rest):
    """The decode form: the compiled step for one token per sequence updating the pool in place
    (recurrence's decode entries), `recurrent_gated_delta_rule` for everything else."""
    if not rest and inplace_final_state and state_indices is not None and q.shape[1] == 1:
        o = kdecode.gdn_recurrent(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool=initial_state,
                                  slots=state_indices, scale=scale, l2=use_qk_l2norm_in_kernel)
        if o is not None:
            return o.unsqueeze(1), initial_state  # [n, 1, HV, V]
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, state_indices=state_indices,
                                      inplace_final_state=inplace_final_state, scale=scale,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **rest)


OPS = RecurrentOps(chunk_gated_delta_rule, _recurrent, chunk_positions=True)


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

    def gates(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(g, beta) [T, HV] from in_proj_a(x), in_proj_b(x): g = log of the state's decay (<= 0)."""
        gates = kdecode.gdn_gates(a, b, self.A_log, self.dt_bias)
        if gates is not None:
            return gates
        beta = torch.sigmoid(b.float())
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        return g, beta

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [T, HV] for the layer's input x [T, hidden]: the state decays by exp(g) per token, per
        value head (the gate the forward applies; for views such as the explorer's memory horizons)."""
        a, b = project(x, self.in_proj_a, self.in_proj_b)
        return self.gates(a, b)[0]

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t = x.shape[0]
        qkv, z, b, a = project(x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)  # one call if fused
        group = batch.groups[0] if batch.decode_only else batch.verify_group  # one token per entry, or drafts
        if group is not None and self.act == "silu":
            clear_fresh(cache.conv, group)  # entries with an empty cache start from zeros
            clear_fresh(cache.state, group)
            args = dict(conv_pool=cache.conv, conv_weight=self.conv_weight, state_pool=cache.state, group=group,
                        A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.norm.weight, norm_eps=self.norm.eps,
                        num_k_heads=self.num_k_heads)
            if batch.decode_only:
                o = kdecode.gdn_decode(qkv, z, a, b, **args)  # [T, HV * V], or None if not served
            else:
                out = kdecode.gdn_verify(qkv, z, a, b, **args)  # (o, states, windows), or None
                o = None if out is None else out[0]
                if out is not None:  # the state and conv window after every token, for keep_states
                    batch.rollback += [(cache.state, group, out[1], True), (cache.conv, group, out[2], True)]
            if o is not None:
                return self.out_proj(o)
        qkv = short_conv(qkv, cache.conv, batch, self.conv_weight, None, self.act)  # [T, conv_dim]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        g, beta = self.gates(a, b)
        tokens = dict(q=q.view(t, self.num_k_heads, self.head_k_dim), k=k.view(t, self.num_k_heads, self.head_k_dim),
                      v=v.view(t, self.num_v_heads, self.head_v_dim), g=g, beta=beta)
        o = recur(OPS, cache.state, batch, tokens, use_qk_l2norm_in_kernel=True)  # [T, HV, V]; state [HV, K, V]
        z = z.reshape(t, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.reshape(t, self.num_v_heads, self.head_v_dim), z)
        return self.out_proj(o.reshape(t, self.value_dim))
