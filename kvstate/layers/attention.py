"""Full (softmax) attention with grouped KV heads over the paged KV pool.

Options cover the families: an output gate (Qwen3.5 / Qwen3-Next: q_proj is twice as wide and
each head's second half gates the output through a sigmoid), per-head q/k RMSNorm, partial
rotary or no positions at all (Jamba and Nemotron-H attention have no RoPE), and biases.
A decode-only step runs everything between the projections as one compiled kernel
(`kernels.decode.attention_decode`) when it serves the call; so does a speculative verify step,
each drafted token one query at its own position (its KV row is written before any is read).
"""

from __future__ import annotations

import torch
from torch import nn

from kvstate.kernels import decode as kdecode
from kvstate.kernels.fused import project
from kvstate.layers.norm import RMSNorm
from kvstate.layers.rope import Rotary
from kvstate.ops.attention import paged_attention, write_kv


class Attention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, output_gate: bool = False,
                 qk_norm: tuple[float, float] | None = None, rotary: Rotary | None = None, key_scale: float = 1.0):
        """qk_norm: (eps, weight offset) of the per-head RMSNorm on q and k, or None; key_scale multiplies
        k_proj's output (Falcon-H1's key_multiplier)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate = output_gate
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        if qk_norm is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm[0], offset=qk_norm[1])
            self.k_norm = RMSNorm(head_dim, qk_norm[0], offset=qk_norm[1])
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary
        self.scale = head_dim**-0.5
        self.key_scale = key_scale

    @classmethod
    def from_spec(cls, spec, hidden_size: int, opts) -> "Attention":
        rotary = None
        if opts.rope_theta is not None:
            rotary_dim = int(spec.head_dim * opts.partial_rotary_factor)
            rotary = Rotary(spec.head_dim, rotary_dim, opts.rope_theta, opts.rope_scaling)
        return cls(hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, qkv_bias=spec.qkv_bias,
                   o_bias=spec.o_bias, output_gate=spec.output_gate,
                   qk_norm=(opts.norm_eps, opts.norm_offset) if spec.qk_norm else None, rotary=rotary,
                   **opts.for_mixer("attention"))

    def forward(self, x: torch.Tensor, batch, cache) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)  # one kernel call when fused
        gate = None
        if self.output_gate:
            # [T, H, 2D]: per head the first D are the query, the last D the gate
            q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # gate [T, H, D]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.key_scale != 1:
            k = k * self.key_scale
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if batch.decode_only or batch.verify_group is not None:  # one query per token row
            o = kdecode.attention_decode(q, k, v, gate, q_norm=self.q_norm,
                                         k_norm=self.k_norm, rotary=self.rotary, batch=batch, k_cache=cache.k,
                                         v_cache=cache.v, scale=self.scale)  # [T, H * D], or None if not served
            if o is not None:
                return self.o_proj(o)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            q, k = self.rotary(q, k, batch.positions)
        write_kv(cache.k, k, batch.kv_indices)
        write_kv(cache.v, v, batch.kv_indices)
        o = paged_attention(q, cache.k, cache.v, batch, scale=self.scale, fresh=(k, v)).reshape(t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)
