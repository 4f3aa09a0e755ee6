"""The mixer kinds of a layer plan: per kind, the dims that size its cache and its weights (no torch).

Each kind is a small frozen dataclass and is the one source of what follows from those dims:
- `kv_shape()`: the cache that grows with the context, per token (attention, MLA), or None;
- `state_shape()`: the fixed recurrent state per request (linear mixers), or None;
- `conv_shape(window)`: the short-conv window per request, `window` "kernel" (W columns, what
  transformers allocates) or "kernel-1" (the W-1 columns a step really reads, as vLLM keeps);
- `params(hidden)`: the mixer's weights as transformers builds them (projections, convs, per-head
  vectors, inner norms, biases; the block's own norms are counted by `kvstate.config.params`).
A family's weight facts (q/k norms, biases, Jamba's inner norms, ...) are fields of its kind, set
by the family adapter, so the count needs no per-family correction.
The cache spec (`kvstate.cache.spec`), the pools, the layers (`from_spec`) and the parameter
estimate (`kvstate.config.params`) all read these; none derives them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union


class _Mixer:
    """Defaults of the cache description: no KV, no recurrent state, no conv window."""

    __slots__ = ()

    def kv_shape(self) -> tuple[int, ...] | None:
        return None

    def state_shape(self) -> tuple[int, ...] | None:
        return None

    def conv_shape(self, window: str = "kernel") -> tuple[int, int] | None:
        """(conv_dim, columns) of the short-conv window, or None without one (or with 0 columns)."""
        kernel = getattr(self, "conv_kernel", 0)
        columns = kernel - (window == "kernel-1")
        return (self.conv_dim, columns) if kernel and columns > 0 else None


@dataclass(frozen=True, slots=True)
class AttentionSpec(_Mixer):
    """Softmax attention with a growing KV cache: per token 2 x num_kv_heads x head_dim values."""

    kind: ClassVar[str] = "attention"
    letter: ClassVar[str] = "A"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    output_gate: bool = False  # Qwen's gated attention: q_proj is twice as wide (half is the gate)
    qk_norm: bool = False  # per-head RMSNorm weights on q and k (Qwen3, Qwen3.5, Qwen3-Next, LFM2)
    qkv_bias: bool = False  # biases on q_proj, k_proj, v_proj (Qwen2; attention_bias elsewhere)
    o_bias: bool = False  # a bias on o_proj (attention_bias, except in Qwen2)

    def kv_shape(self) -> tuple[int, ...]:
        return (2, self.num_kv_heads, self.head_dim)  # K and V

    def params(self, hidden: int) -> int:
        q = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        qkv = q + 2 * self.num_kv_heads * self.head_dim  # q_proj, k_proj, v_proj output widths
        weights = hidden * qkv + self.num_heads * self.head_dim * hidden
        return (weights + 2 * self.head_dim * self.qk_norm + qkv * self.qkv_bias + hidden * self.o_bias)


@dataclass(frozen=True, slots=True)
class MLASpec(_Mixer):
    """Multi-head latent attention: caches one latent of kv_lora_rank + qk_rope_head_dim per token."""

    kind: ClassVar[str] = "mla"
    letter: ClassVar[str] = "L"
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: q_proj maps hidden -> heads directly (Kimi Linear)
    bias: bool = False  # attention_bias: q_a_proj (if any), kv_a_proj_with_mqa and o_proj carry biases

    def kv_shape(self) -> tuple[int, ...]:
        return (self.kv_lora_rank + self.qk_rope_head_dim,)  # one latent, no separate V

    def params(self, hidden: int) -> int:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self.q_lora_rank:  # q_a_proj, its norm, q_b_proj
            q = hidden * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk
        else:
            q = hidden * self.num_heads * qk
        kv_a = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank  # + kv_a_layernorm
        kv_b = self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        biases = (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim + hidden
        return q + kv_a + kv_b + self.num_heads * self.v_head_dim * hidden + biases * self.bias


@dataclass(frozen=True, slots=True)
class GatedDeltaNetSpec(_Mixer):
    """Gated DeltaNet: state [num_v_heads, head_k_dim, head_v_dim]; conv over q, k and v channels."""

    kind: ClassVar[str] = "gated_deltanet"
    letter: ClassVar[str] = "G"
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    def state_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def params(self, hidden: int) -> int:
        key, value = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        in_proj = hidden * (2 * key + 2 * value + 2 * self.num_v_heads)  # q, k, v, z, b, a
        per_head = 2 * self.num_v_heads + self.head_v_dim  # dt_bias, A_log, gated RMSNorm weight
        return in_proj + self.conv_dim * self.conv_kernel + per_head + value * hidden


@dataclass(frozen=True, slots=True)
class KDASpec(_Mixer):
    """Kimi Delta Attention: state [num_heads, head_dim, head_dim]; separate q, k, v short convs."""

    kind: ClassVar[str] = "kda"
    letter: ClassVar[str] = "K"
    num_heads: int
    head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim

    def state_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.head_dim)

    def params(self, hidden: int) -> int:
        inner, d = self.num_heads * self.head_dim, self.head_dim
        proj = 3 * hidden * inner + inner * hidden  # q, k, v, o
        gates = 2 * (hidden * d + d * inner) + hidden * self.num_heads  # f_a/f_b, g_a/g_b low rank, b_proj
        return proj + gates + self.conv_dim * self.conv_kernel + inner + self.num_heads + d  # dt_bias, A_log, o_norm


@dataclass(frozen=True, slots=True)
class Mamba2Spec(_Mixer):
    """Mamba-2 (SSD): state [num_heads, d_state, head_dim]; conv over x, B and C channels."""

    kind: ClassVar[str] = "mamba2"
    letter: ClassVar[str] = "M"
    num_heads: int
    head_dim: int
    d_state: int
    n_groups: int
    conv_kernel: int
    in_proj_bias: bool = False  # use_bias / mamba_proj_bias
    out_proj_bias: bool = False  # use_bias (Falcon-H1: projectors_bias)
    conv_bias: bool = True  # use_conv_bias / mamba_conv_bias
    gated_norm: bool = True  # the gated RMSNorm before out_proj (Falcon-H1 only with mamba_rms_norm)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.d_state

    def state_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.d_state, self.head_dim)

    def params(self, hidden: int) -> int:
        projected = self.d_inner + self.conv_dim + self.num_heads  # in_proj outputs: z, x B C, dt
        in_proj = (hidden + self.in_proj_bias) * projected
        conv = self.conv_dim * (self.conv_kernel + self.conv_bias)
        out_proj = self.d_inner * hidden + hidden * self.out_proj_bias
        return in_proj + conv + 3 * self.num_heads + self.d_inner * self.gated_norm + out_proj  # dt_bias, A, D


@dataclass(frozen=True, slots=True)
class Mamba1Spec(_Mixer):
    """Mamba-1 selective scan: state [d_inner, d_state]; conv over the d_inner channels."""

    kind: ClassVar[str] = "mamba1"
    letter: ClassVar[str] = "S"
    d_inner: int
    d_state: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool = True  # mamba_conv_bias
    proj_bias: bool = False  # mamba_proj_bias: in_proj and out_proj
    inner_norms: bool = True  # Jamba's RMSNorms on dt, B and C (plain Mamba-1 has none)

    @property
    def conv_dim(self) -> int:
        return self.d_inner

    def state_shape(self) -> tuple[int, ...]:
        return (self.d_inner, self.d_state)

    def params(self, hidden: int) -> int:
        d, n, r = self.d_inner, self.d_state, self.dt_rank
        in_proj, conv = (hidden + self.proj_bias) * 2 * d, d * (self.conv_kernel + self.conv_bias)
        x_proj, dt_proj = d * (r + 2 * n), r * d + d  # dt_proj always has its bias
        out_proj = d * hidden + hidden * self.proj_bias
        norms = (r + 2 * n) * self.inner_norms
        return in_proj + conv + x_proj + dt_proj + d * n + d + out_proj + norms  # A_log, D


@dataclass(frozen=True, slots=True)
class ShortConvSpec(_Mixer):
    """A gated short causal convolution (LFM2): no recurrent state, a conv window over `dim` channels."""

    kind: ClassVar[str] = "short_conv"
    letter: ClassVar[str] = "C"
    dim: int
    kernel: int
    bias: bool = False  # conv_bias: the conv, in_proj and out_proj carry biases

    @property
    def conv_dim(self) -> int:
        return self.dim

    @property
    def conv_kernel(self) -> int:
        return self.kernel

    def params(self, hidden: int) -> int:
        weights = hidden * 3 * self.dim + self.dim * self.kernel + self.dim * hidden  # in_proj (B C x), conv, out_proj
        return weights + (3 * self.dim + self.dim + hidden) * self.bias


MixerSpec = Union[AttentionSpec, MLASpec, GatedDeltaNetSpec, KDASpec, Mamba2Spec, Mamba1Spec, ShortConvSpec]
MIXER_KINDS: tuple[type, ...] = (AttentionSpec, MLASpec, GatedDeltaNetSpec, KDASpec, Mamba2Spec, Mamba1Spec,
                                 ShortConvSpec)
KV_KINDS = frozenset(cls.kind for cls in MIXER_KINDS if cls.kv_shape is not _Mixer.kv_shape)  # cache grows
LETTERS: dict[str, str] = {cls.kind: cls.letter for cls in MIXER_KINDS}
