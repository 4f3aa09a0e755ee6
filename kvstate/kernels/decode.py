"""The small ops of a decode step as compiled kernels: norms, GDN's gates, conv and state updates.

Around its GEMVs a decode step runs, per layer, a few dozen torch ops on vectors of a few thousand
floats (an RMSNorm alone is ~8 ops and temporaries): at batch 1 their dispatch costs about as much
as streaming a third of the weights. Each function here runs the extension's kernel (csrc/
decode_ops.cpp: one pass, no temporaries) when it serves the call and returns None when it does
not, and the layer then runs its torch code, which stays the reference. A kernel serves CPU
float32 inputs of at most `MAX_ROWS` rows (tokens: decode, not prefill), outside autograd, with
the extension built; `KVSTATE_KERNELS=torch` or `kernels.backend("torch")` turn them off with the
linear kernels. State pools are updated in place at the entries' slots, as the torch path does.
"""

from __future__ import annotations

import torch

from kvstate.kernels import _ext
from kvstate.kernels.dispatch import _DEFAULT, _forced
from kvstate.kernels.threads import _wide
from kvstate.profiling import timed

MAX_ROWS = 64
# Bytes a call streams from which it gets all threads inside `small_ops_serial`: recurrent state
# (read and written) and KV rows (read). From a quarter MiB the second thread's share of the bytes
# outweighs waking it: the 0.5b model's steps are faster with these calls wide at batch 1 and 8
# (docs/benchmarks.md, "Kernel history").
WIDE_STATE_BYTES = 256 << 10
WIDE_KV_BYTES = 256 << 10


def _ext_for(rows: int, *tensors: torch.Tensor | None):
    """The extension if its kernels serve these tensors (float32, CPU, no autograd, few rows), else None.
    (Runs a few times per layer and step: the cheapest tests first, no environment or ISA lookup.)"""
    if rows > MAX_ROWS or (_forced.get() or _DEFAULT) == "torch":
        return None
    if torch.is_grad_enabled():
        if any(t is not None and t.requires_grad for t in tensors):
            return None
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            return None
    return _ext.load()


def _num_rows(x: torch.Tensor) -> int:
    return x.shape[0] if x.dim() == 2 else x.numel() // max(x.shape[-1], 1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as [rows, D] with a contiguous last dimension (x itself, or a view, when possible)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def state_bytes(pool: torch.Tensor, n: int) -> int:
    """Bytes of n float32 state rows of `pool` [slots, ...] (read and written by a recurrent step)."""
    return n * pool[0].numel() * 4


def kv_bytes(tokens: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Bytes of keys and values an attention step reads over `tokens` keys in all (a decode step's:
    sum(batch.kv_lens))."""
    return tokens * k_cache.shape[2] * (k_cache.shape[3] + v_cache.shape[3]) * 4


def _wide_call(state_bytes: int, fn, *args, threshold: int | None = None):
    """fn(*args), with all the step's threads when the state it streams is big (`threshold` bytes,
    default WIDE_STATE_BYTES)."""
    wide = _wide.get()
    if wide is None or state_bytes < (WIDE_STATE_BYTES if threshold is None else threshold):
        return fn(*args)
    torch.set_num_threads(wide)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor | None:
    """x [..., D] * rsqrt(mean(x^2) + eps) * (weight + offset), or None."""
    ext = _ext_for(_num_rows(x), x, weight)
    if ext is None or x.shape[-1] == 0 or not weight.is_contiguous():
        return None
    return ext.rms_norm(x, weight, eps, offset)


@timed("norm")
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
    """(x + delta, rms_norm(x + delta)) for x, delta [T, D] (a residual add and the next norm), or None."""
    ext = _ext_for(x.shape[0], x, delta, weight)
    if ext is None or x.dim() != 2 or delta.shape != x.shape or not weight.is_contiguous():
        return None
    return ext.add_rms_norm(_rows(x), _rows(delta), weight, eps, offset)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for [T, N] (the gated MLP between its projections), or None."""
    ext = _ext_for(gate.shape[0], gate, up)
    if ext is None or gate.dim() != 2 or up.shape != gate.shape:
        return None
    return ext.silu_mul(_rows(gate), _rows(up))


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """rmsnorm(x [..., D]) * weight * silu(gate) (norm before gate, one group), or None."""
    ext = _ext_for(_num_rows(x), x, gate, weight)
    if ext is None or x.shape[-1] == 0 or not weight.is_contiguous() or gate.shape != x.shape:
        return None
    return ext.gated_rms_norm(x, gate, weight, eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) [T, HV] = (-exp(A_log) * softplus(a + dt_bias), sigmoid(b)) for a, b [T, HV], or None."""
    ext = _ext_for(a.shape[0], a, b, A_log, dt_bias)
    if ext is None or a.dim() != 2 or b.shape != a.shape or not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        return None
    return ext.gdn_gates(_rows(a), _rows(b), A_log, dt_bias)


def conv_update(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, activation: str | None) -> torch.Tensor | None:
    """One causal-conv1d step: x [n, D], the windows pool[slots] [n, D, S] shifted in place -> y [n, D], or None."""
    ext = _ext_for(x.shape[0], x, pool, weight, bias)
    if ext is None or activation not in (None, "silu") or x.dim() != 2 or not pool.is_contiguous() \
            or not weight.is_contiguous() or (bias is not None and not bias.is_contiguous()):
        return None
    return ext.conv_update(_rows(x), pool, slots, weight, bias, activation == "silu")


def copy_rows(dst: list, dst_rows: list[int], src: list, src_rows: list[int]) -> bool:
    """dst[i][dst_rows[i]] = src[i][src_rows[i]] for every i in one compiled call (a verify step's
    rollback: each layer's pools keep the state after the accepted tokens); False, nothing copied,
    where the kernels do not serve it (the caller copies with torch)."""
    if (_forced.get() or _DEFAULT) == "torch":
        return False
    for d, t in zip(dst, src):
        if d.dtype != t.dtype or not (d.is_cpu and t.is_cpu and d.is_contiguous() and t.is_contiguous()):
            return False
    ext = _ext.load()
    if ext is None:
        return False
    ext.copy_rows(dst, dst_rows, src, src_rows)
    return True


def gdn_recurrent(q, k, v, g, beta, *, pool: torch.Tensor, slots: torch.Tensor, scale: float | None,
                  l2: bool) -> torch.Tensor | None:
    """One gated-delta-rule token per sequence: q, k [n, H, K], v [n, HV, V], g, beta [n, HV]; the
    states pool[slots] [n, HV, K, V] updated in place -> o [n, HV, V], or None."""
    ext = _ext_for(q.shape[0], q, k, v, g, beta, pool)
    if ext is None or not pool.is_contiguous():
        return None
    dk = pool.shape[2]
    return _wide_call(state_bytes(pool, q.shape[0]), ext.gdn_recurrent, q, k, v, g, beta, pool, slots,
                      dk**-0.5 if scale is None else float(scale), l2)


@timed("recurrent")
def gdn_decode(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, conv_pool: torch.Tensor,
               conv_weight: torch.Tensor, state_pool: torch.Tensor, group, A_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float,
               num_k_heads: int) -> torch.Tensor | None:
    """Gated DeltaNet between in_proj and out_proj for one token per sequence (the decode `group`):
    conv window + SiLU, q/k l2norm (q scaled by K^-0.5), gates, state update, gated RMSNorm
    -> o [n, HV * V]; both pools updated in place at the group's slots, whose fresh entries the
    caller has zeroed (`recurrence.clear_fresh`). None when not served."""
    n = qkv.shape[0]
    ext = _ext_for(n, qkv, z, a, b, conv_pool, conv_weight, state_pool, A_log, dt_bias, norm_weight)
    if ext is None or not (conv_pool.is_contiguous() and state_pool.is_contiguous()):
        return None
    dk = state_pool.shape[2]
    return _wide_call(state_bytes(state_pool, n), ext.gdn_decode, qkv, z, a, b, conv_pool, conv_weight, state_pool,
                      group.slots, A_log, dt_bias, norm_weight, norm_eps, dk**-0.5, num_k_heads)


def gdn_verify(qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, conv_pool: torch.Tensor,
               conv_weight: torch.Tensor, state_pool: torch.Tensor, group, A_log: torch.Tensor,
               dt_bias: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, num_k_heads: int):
    """`gdn_decode` for entries of several tokens (speculative decoding's verify step; `group` covers
    the whole step, its cu_seqlens the entries' tokens): -> (o [T, HV * V], states [T, HV, K, V],
    windows [T, D, S]), the state and conv window after every token but each entry's first, whose
    state the pools hold (updated in place, as a decode; `recurrence.keep_states` copies a longer
    kept run's). The caller has zeroed fresh entries' slots. None when not served."""
    ext = _ext_for(qkv.shape[0], qkv, z, a, b, conv_pool, conv_weight, state_pool, A_log, dt_bias, norm_weight)
    if ext is None or not (conv_pool.is_contiguous() and state_pool.is_contiguous()):
        return None
    dk = state_pool.shape[2]
    return _wide_call(state_bytes(state_pool, qkv.shape[0]), ext.gdn_verify, qkv, z, a, b, conv_pool, conv_weight,
                      state_pool, group.slots, group.cu_seqlens, A_log, dt_bias, norm_weight, norm_eps, dk**-0.5,
                      num_k_heads)


@timed("attention")
def attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gate: torch.Tensor | None, *, q_norm,
                     k_norm, rotary, batch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     scale: float) -> torch.Tensor | None:
    """Full attention for one query per token row (a decode-only `batch`, or decode and verify entries
    with `batch.token_tables`): q [n, H, D], k [n, Hkv, D],
    v [n, Hkv, Dv], gate [n, H, Dv] or None; q_norm / k_norm the per-head RMSNorms or None; rotary
    the layer's `Rotary` or None. Writes k (normed, rotated) and v at the batch's KV rows and
    returns o [n, H * Dv] (gated), or None when not served."""
    inv_freq = None if rotary is None else rotary.inv_freq
    qw = None if q_norm is None else q_norm.weight
    kw = None if k_norm is None else k_norm.weight
    ext = _ext_for(q.shape[0], q, k, v, gate, qw, kw, inv_freq, k_cache, v_cache)
    if ext is None or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or (q_norm is None) != (k_norm is None):
        return None
    if q_norm is not None and (q_norm.eps != k_norm.eps or q_norm.offset != k_norm.offset):
        return None
    if rotary is not None and 2 * inv_freq.numel() != rotary.rotary_dim:
        return None
    eps, offset = (0.0, 0.0) if q_norm is None else (q_norm.eps, q_norm.offset)
    tables = batch.block_tables if batch.token_tables is None else batch.token_tables  # [T, max_blocks]
    read = kv_bytes(sum(batch.kv_lens), k_cache, v_cache)
    return _wide_call(read, ext.attention_decode, q, k, v, gate, qw, kw, eps, offset,
                      inv_freq, batch.positions, k_cache, v_cache, tables, batch.kv_indices, scale,
                      threshold=WIDE_KV_BYTES)
