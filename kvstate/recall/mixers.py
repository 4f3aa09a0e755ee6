"""The token mixers of the tiny recall models, one letter each, all trainable with autograd.

Attention, Gated DeltaNet, KDA and Mamba-2 are kvstate's own layer classes (`kvstate.layers`),
run over a packed batch with fresh cache tensors (`Packed`); linear attention and DeltaNet have
no layer class, so they are small modules over their chunk ops. Every mixer has one short causal
conv (kernel 4) before its token mixing: the recurrent layers convolve their q/k/v channels (their
own design), attention convolves its input (`x + conv(x)`), since without it tiny attention cannot
form the induction head MQAR needs (the recipe: it stalls at ~4%). q and k of the linear mixers are
L2-normalised in the kernels. A fixed-state mixer's state is heads x key_dim x value_dim numbers
(key_dim = value_dim here, so `--key-dim` grows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.errors import KvstateError
from kvstate.layers.attention import Attention
from kvstate.layers.gated_deltanet import GatedDeltaNet
from kvstate.layers.kda import KimiDeltaAttention
from kvstate.layers.mamba2 import Mamba2
from kvstate.layers.norm import RMSNorm
from kvstate.models.batch import Batch
from kvstate.ops import causal_conv1d, chunk_delta_rule, chunk_linear_attention

KINDS = {"A": "attention", "L": "linear attention", "D": "DeltaNet", "G": "Gated DeltaNet", "K": "KDA",
         "M": "Mamba-2"}
CONV = 4  # short conv kernel before every mixer


@dataclass(frozen=True)
class MixerSize:
    width: int
    heads: int
    key_dim: int  # per head; value_dim = key_dim
    conv: bool = True

    def state_numbers(self, kind: str) -> int:
        """Numbers in one sequence's fixed state of a `kind` layer (0 for attention: its KV grows)."""
        return 0 if kind == "A" else self.heads * self.key_dim * self.key_dim


@dataclass(frozen=True)
class Packed:
    """B sequences of T tokens as one packed prefill batch (sequence i: KV block i, state slot i)."""

    batch: Batch
    num_seqs: int
    seq_len: int

    @classmethod
    def of(cls, b: int, t: int, device=None) -> "Packed":
        return cls(Batch.build([t] * b, [0] * b, list(range(b)), [[i] for i in range(b)], t, logits="all",
                               device=device), b, t)


def _init_decay(layer: nn.Module, dt_shape: int) -> None:
    """fla / mamba_ssm init: A ~ U(1, 16), dt ~ logU(1e-3, 1e-1) through softplus; slow decays to start."""
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(dt_shape) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        layer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


def _init_conv(weight: torch.Tensor) -> None:
    nn.init.uniform_(weight, -1 / math.sqrt(weight.shape[1]), 1 / math.sqrt(weight.shape[1]))


class LayerMixer(nn.Module):
    """A kvstate layer class over [B, T, width]: packed into its (x [B*T, width], batch, cache) call,
    with zeroed cache tensors the layer writes (its KV or its conv window and final state).
    Attention trains through `_attention` (one batched SDPA call with the layer's weights)."""

    batched_attention = True  # False: through the layer's paged path (the test compares the two)

    def __init__(self, kind: str, size: MixerSize):
        super().__init__()
        w, h, d = size.width, size.heads, size.key_dim
        self.kind = kind
        self.pre_conv = None
        if kind == "A":
            self.layer = Attention(w, h, h, w // h)
            assert self.layer.q_norm is None and self.layer.rotary is None and not self.layer.output_gate
            if size.conv:  # the short conv of attention: residual, so the token itself passes through
                self.pre_conv = nn.Parameter(torch.zeros(w, CONV))
                _init_conv(self.pre_conv)
        elif kind == "G":
            self.layer = GatedDeltaNet(w, h, h, d, d, CONV)
            _init_decay(self.layer, h)
        elif kind == "K":
            self.layer = KimiDeltaAttention(w, h, d, CONV)
            _init_decay(self.layer, h * d)
        elif kind == "M":
            self.layer = Mamba2(w, h, d, d, 1, CONV)
            _init_decay(self.layer, h)
        else:
            raise KvstateError(f"no layer class for mixer {kind!r}")
        if hasattr(self.layer, "conv_weight"):
            _init_conv(self.layer.conv_weight)
            if not size.conv:  # only the current tap: the conv does nothing but the activation
                with torch.no_grad():
                    self.layer.conv_weight.zero_()
                    self.layer.conv_weight[:, -1] = 1
                self.layer.conv_weight.requires_grad_(False)

    def _cache(self, p: Packed, like: torch.Tensor) -> SimpleNamespace:
        zeros = lambda *s: like.new_zeros(*s)  # noqa: E731
        layer = self.layer
        if self.kind == "A":
            return SimpleNamespace(k=zeros(p.num_seqs, p.seq_len, layer.num_kv_heads, layer.head_dim),
                                   v=zeros(p.num_seqs, p.seq_len, layer.num_kv_heads, layer.head_dim))
        conv_dim = layer.conv_weight.shape[0]
        if self.kind == "G":
            state = (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
        elif self.kind == "K":
            state = (layer.num_heads, layer.head_dim, layer.head_dim)
        else:
            state = (layer.num_heads, layer.d_state, layer.head_dim)
        return SimpleNamespace(conv=zeros(p.num_seqs, conv_dim, CONV), state=zeros(p.num_seqs, *state))

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        b, t, w = x.shape
        if self.pre_conv is not None:
            x = x + causal_conv1d(x, self.pre_conv)[0]  # [B, T, W]
        if self.kind == "A" and self.batched_attention:
            return self._attention(x)
        return self.layer(x.reshape(b * t, w), p.batch, self._cache(p, x)).view(b, t, w)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        """The attention layer's prefill on B sequences of equal length as one causal SDPA call, with
        the layer's own weights. Its paged path runs one SDPA per sequence and scatters K/V into a
        cache; an `AA` training step (width 64, 64 tokens, batch 64) took 0.28 s that way, 0.10 s
        this way. Same numbers (tested); the recall model's attention has no q/k norm, rotary or
        output gate."""
        layer = self.layer
        b, t, _ = x.shape
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = layer.q_proj(x).view(b, t, h, d).transpose(1, 2)  # [B, H, T, D]
        k = layer.k_proj(x).view(b, t, hkv, d).transpose(1, 2)
        v = layer.v_proj(x).view(b, t, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
        return layer.o_proj(o.transpose(1, 2).reshape(b, t, h * d))


class OpMixer(nn.Module):
    """Linear attention (`L`) or DeltaNet (`D`) over its chunk op: qkv projection, short conv (SiLU),
    L2-normalised q and k, the op, per-head RMSNorm of the output (as fla's LinearAttention and
    DeltaNet: an unnormalised sum over the context grows with its length), output projection;
    DeltaNet adds beta = sigmoid(b(x))."""

    def __init__(self, kind: str, size: MixerSize):
        super().__init__()
        self.kind, self.heads, self.key_dim = kind, size.heads, size.key_dim
        inner = size.heads * size.key_dim
        self.qkv = nn.Linear(size.width, 3 * inner, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(3 * inner, CONV)) if size.conv else None
        if self.conv_weight is not None:
            _init_conv(self.conv_weight)
        self.b = nn.Linear(size.width, size.heads, bias=False) if kind == "D" else None
        self.norm = RMSNorm(size.key_dim)
        self.out = nn.Linear(inner, size.width, bias=False)

    def forward(self, x: torch.Tensor, p: Packed) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)  # [B, T, 3 * H * K]
        if self.conv_weight is not None:
            qkv = causal_conv1d(qkv, self.conv_weight, activation="silu")[0]
        else:
            qkv = F.silu(qkv)
        q, k, v = (z.reshape(b, t, self.heads, self.key_dim) for z in qkv.chunk(3, dim=-1))
        if self.b is None:
            o, _ = chunk_linear_attention(q, k, v, use_qk_l2norm_in_kernel=True)
        else:
            o, _ = chunk_delta_rule(q, k, v, torch.sigmoid(self.b(x)), use_qk_l2norm_in_kernel=True)
        return self.out(self.norm(o).reshape(b, t, -1))  # o [B, T, H, K]


def make_mixer(kind: str, size: MixerSize) -> nn.Module:
    if kind not in KINDS:
        raise KvstateError(f"unknown mixer {kind!r}: one of {', '.join(f'{k} ({v})' for k, v in KINDS.items())}")
    return OpMixer(kind, size) if kind in "LD" else LayerMixer(kind, size)
