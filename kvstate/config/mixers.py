"""The mixer kinds of a layer plan: per kind, the dims that size its cache and its weights (no torch).

Each kind is a small frozen dataclass and is the one source of what follows from those dims:
- `kv_shape()`: the cache that grows with the context, per token (attention, MLA), or None;
- `state_shape()`: the fixed recurrent state per request (linear mixers), or None;
- `conv_shape(window)`: the short-conv window per request, `window` "kernel" (W columns, what
  transformers allocates) or "kernel-1" (the W-1 columns a step really reads, as vLLM keeps);
- `params(hidden)`: the mixer's weights as transformers builds them (projections, convs, per-head
  vectors, inner norms, biases; the block's own norms are counted by `kvstate.config.params`);
- under tensor parallelism (`kvstate.config.cuts`, applied by `kvstate.parallel`): `tp_problems(tp)`
  (what does not divide, one line each), `tp_local(tp)` (a rank's spec: its heads or channels),
  `tp_cuts(tp, rank)` (the rank's slice of each of the layer's parameters, and the row-parallel
  biases only rank 0 keeps), `tp_reduced` (inner projections whose output is summed over ranks)
  and `tp_norm_group(tp, rank)` (an output norm whose groups span ranks).
A family's weight facts (q/k norms, biases, Jamba's inner norms, ...) are fields of its kind, set
by the family adapter, so the count needs no per-family correction.
The cache spec (`kvstate.cache.spec`), the pools, the layers (`from_spec`) and the parameter
estimate (`kvstate.config.params`) all read these; none derives them again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar, Union

from kvstate.config.cuts import Cut, cols, divides, part, rows, spread_range, spreads

Cuts = tuple[dict[str, Cut], tuple[str, ...]]  # (cut by parameter name within the layer, row-parallel biases)


def _found(*problems: str | None) -> list[str]:
    return [p for p in problems if p]


def _channel_cuts(d: int, segments: int, tp: int, r: int) -> tuple[Cut, Cut, Cut]:
    """A mixer over d channels, each rank a share of them: (rows of a per-channel parameter, rows of an
    input projection of `segments` d-wide parts, columns of a projection back from the channels)."""
    return rows(d, part(d, tp, r)), rows(segments * d, *(part(d, tp, r, k * d) for k in range(segments))), \
        cols(d, part(d, tp, r))


class _Mixer:
    """Defaults of the cache description: no KV, no recurrent state, no conv window."""

    __slots__ = ()
    tp_reduced: ClassVar[tuple[str, ...]] = ()  # inner projections whose output is all-reduced (row-parallel)

    def tp_problems(self, tp: int) -> list[str]:
        return [f"{self.kind} mixers are not sharded"]

    def tp_local(self, tp: int):
        raise ValueError(f"{self.kind} mixers are not sharded")

    def tp_cuts(self, tp: int, rank: int) -> Cuts:
        raise ValueError(f"{self.kind} mixers are not sharded")

    def tp_norm_group(self, tp: int, rank: int) -> tuple[int, int, int] | None:
        """(channels per group, the rank's group, groups) of an output norm whose groups span ranks, else None."""
        return None

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

    def tp_problems(self, tp: int) -> list[str]:  # KV heads fewer than ranks are replicated
        return _found(divides("attention heads", self.num_heads, tp),
                      spreads("attention KV heads", self.num_kv_heads, tp))

    def tp_local(self, tp: int) -> AttentionSpec:
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp))

    def tp_cuts(self, tp: int, rank: int) -> Cuts:
        qd, d = self.head_dim * (2 if self.output_gate else 1), self.head_dim
        q = rows(self.num_heads * qd, part(self.num_heads, tp, rank, unit=qd))
        a, b = spread_range(self.num_kv_heads, tp, rank)
        kv = rows(self.num_kv_heads * d, (a * d, b * d))
        o = cols(self.num_heads * d, part(self.num_heads, tp, rank, unit=d))
        return {"q_proj.weight": q, "q_proj.bias": q, "k_proj.weight": kv, "k_proj.bias": kv, "v_proj.weight": kv,
                "v_proj.bias": kv, "o_proj.weight": o}, ("o_proj.bias",)


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

    def tp_problems(self, tp: int) -> list[str]:  # the latent cache is replicated
        return _found(divides("MLA heads", self.num_heads, tp))

    def tp_local(self, tp: int) -> MLASpec:
        return replace(self, num_heads=self.num_heads // tp)

    def tp_cuts(self, tp: int, rank: int) -> Cuts:
        h, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        kvb = self.qk_nope_head_dim + self.v_head_dim
        q = rows(h * qk, part(h, tp, rank, unit=qk))
        kv_b = rows(h * kvb, part(h, tp, rank, unit=kvb))
        o = cols(h * self.v_head_dim, part(h, tp, rank, unit=self.v_head_dim))
        cuts = {"q_proj.weight": q, "q_b_proj.weight": q, "kv_b_proj.weight": kv_b, "o_proj.weight": o}
        return cuts, ("o_proj.bias",)


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

    def tp_problems(self, tp: int) -> list[str]:
        return _found(divides("Gated DeltaNet key heads", self.num_k_heads, tp),
                      divides("Gated DeltaNet value heads", self.num_v_heads, tp))

    def tp_local(self, tp: int) -> GatedDeltaNetSpec:
        return replace(self, num_k_heads=self.num_k_heads // tp, num_v_heads=self.num_v_heads // tp)

    def tp_cuts(self, tp: int, r: int) -> Cuts:
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        key, val = hk * dk, hv * dv
        conv = rows(2 * key + val, part(hk, tp, r, 0, dk), part(hk, tp, r, key, dk), part(hv, tp, r, 2 * key, dv))
        heads = rows(hv, part(hv, tp, r))
        return {"in_proj_qkv.weight": conv, "conv_weight": conv, "in_proj_z.weight": rows(val, part(hv, tp, r, 0, dv)),
                "in_proj_b.weight": heads, "in_proj_a.weight": heads, "A_log": heads, "dt_bias": heads,
                "out_proj.weight": cols(val, part(hv, tp, r, 0, dv))}, ()


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

    def tp_problems(self, tp: int) -> list[str]:
        return _found(divides("KDA heads", self.num_heads, tp))

    def tp_local(self, tp: int) -> KDASpec:
        return replace(self, num_heads=self.num_heads // tp)

    def tp_cuts(self, tp: int, r: int) -> Cuts:
        h, d = self.num_heads, self.head_dim
        dim = h * d
        qkv = rows(3 * dim, *(part(h, tp, r, p * dim, d) for p in range(3)))
        chan, heads = rows(dim, part(h, tp, r, 0, d)), rows(h, part(h, tp, r))
        return {"qkv_proj.weight": qkv, "conv_weight": qkv, "f_b_proj.weight": chan, "A_log": heads, "dt_bias": chan,
                "b_proj.weight": heads, "g_b_proj.weight": chan, "o_proj.weight": cols(dim, part(h, tp, r, 0, d))}, ()


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

    def tp_problems(self, tp: int) -> list[str]:  # B/C groups fewer than ranks are replicated
        return _found(divides("Mamba-2 heads", self.num_heads, tp), spreads("Mamba-2 groups", self.n_groups, tp))

    def tp_local(self, tp: int) -> Mamba2Spec:
        return replace(self, num_heads=self.num_heads // tp, n_groups=max(1, self.n_groups // tp))

    def tp_cuts(self, tp: int, r: int) -> Cuts:
        h, p, n, g = self.num_heads, self.head_dim, self.d_state, self.n_groups
        inner, gn = h * p, g * n
        ga, gb = spread_range(g, tp, r)  # the rank's B/C groups (one, replicated, when fewer than ranks)
        x = lambda base: part(h, tp, r, base, p)  # noqa: E731
        bc = lambda base: (base + ga * n, base + gb * n)  # noqa: E731
        conv = rows(inner + 2 * gn, x(0), bc(inner), bc(inner + gn))
        proj = rows(2 * inner + 2 * gn + h, x(0), x(inner), bc(2 * inner), bc(2 * inner + gn),
                    part(h, tp, r, 2 * inner + 2 * gn))
        heads = rows(h, part(h, tp, r))
        return {"in_proj.weight": proj, "in_proj.bias": proj, "conv_weight": conv, "conv_bias": conv,
                "dt_bias": heads, "A_log": heads, "D": heads, "norm.weight": rows(inner, x(0)),
                "out_proj.weight": cols(inner, x(0))}, ("out_proj.bias",)

    def tp_norm_group(self, tp: int, rank: int) -> tuple[int, int, int] | None:
        if not self.gated_norm or self.n_groups >= tp:
            return None
        return self.d_inner // self.n_groups, rank // (tp // self.n_groups), self.n_groups


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
    tp_reduced: ClassVar[tuple[str, ...]] = ("x_proj",)  # row-parallel inside the mixer

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

    def tp_problems(self, tp: int) -> list[str]:
        return _found(divides("Mamba-1 inner channels", self.d_inner, tp))

    def tp_local(self, tp: int) -> Mamba1Spec:
        return replace(self, d_inner=self.d_inner // tp)

    def tp_cuts(self, tp: int, r: int) -> Cuts:
        chan, proj, out = _channel_cuts(self.d_inner, 2, tp, r)  # in_proj: [x | z]
        return {"in_proj.weight": proj, "in_proj.bias": proj, "conv_weight": chan, "conv_bias": chan,
                "x_proj.weight": out, "dt_proj.weight": chan, "dt_proj.bias": chan, "A_log": chan, "D": chan,
                "out_proj.weight": out}, ("out_proj.bias",)


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

    def tp_problems(self, tp: int) -> list[str]:
        return _found(divides("short-conv channels", self.dim, tp))

    def tp_local(self, tp: int) -> ShortConvSpec:
        return replace(self, dim=self.dim // tp)

    def tp_cuts(self, tp: int, r: int) -> Cuts:
        chan, proj, out = _channel_cuts(self.dim, 3, tp, r)  # in_proj: [B | C | x]
        cuts = dict.fromkeys(("conv_weight", "conv_bias"), chan)
        return cuts | dict.fromkeys(("in_proj.weight", "in_proj.bias"), proj) | {"out_proj.weight": out}, \
            ("out_proj.bias",)


MixerSpec = Union[AttentionSpec, MLASpec, GatedDeltaNetSpec, KDASpec, Mamba2Spec, Mamba1Spec, ShortConvSpec]
MIXER_KINDS: tuple[type, ...] = (AttentionSpec, MLASpec, GatedDeltaNetSpec, KDASpec, Mamba2Spec, Mamba1Spec,
                                 ShortConvSpec)
KV_KINDS = frozenset(cls.kind for cls in MIXER_KINDS if cls.kv_shape is not _Mixer.kv_shape)  # cache grows
LETTERS: dict[str, str] = {cls.kind: cls.letter for cls in MIXER_KINDS}
