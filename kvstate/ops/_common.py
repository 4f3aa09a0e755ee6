"""Shared pieces of the ops: argument checks, sequence bounds, compute dtype, L2 norm, grouped heads
and varlen packing.

Layouts (DESIGN.md): tokens [B, T, H, D]; a packed variable-length batch is [1, sum(T), H, D]
with `cu_seqlens` (int, [N + 1], FlashAttention convention); states [N, HV, K, V] in fp32.
"""

from __future__ import annotations

import torch

_FLOAT = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check(name: str, x: torch.Tensor | None, ndim: int | None = None, *, shape: tuple | None = None,
          floating: bool = True) -> None:
    """Raise ValueError naming `name` if `x` is not a tensor of the expected rank/shape/dtype.

    `shape` may hold None for dimensions that are free.
    """
    if x is None:
        raise ValueError(f"{name} is required")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, x.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)}")
    if floating and x.dtype not in _FLOAT:
        raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """q, k [B, T, H, K] and v [B, T, HV, V] with HV a multiple of H -> (B, T, H, K, HV, V)."""
    check("q", q, 4)
    b, t, h, dk = q.shape
    check("k", k, shape=(b, t, h, dk))
    check("v", v, 4)
    if v.shape[:2] != (b, t):
        raise ValueError(f"v must have shape [{b}, {t}, HV, V] like q, got {tuple(v.shape)}")
    hv, dv = v.shape[2], v.shape[3]
    if hv % h:
        raise ValueError(f"v's value heads ({hv}) must be a multiple of the key heads of q and k ({h})")
    return b, t, h, dk, hv, dv


def check_cu_seqlens(cu_seqlens: torch.Tensor | None, batch: int, total: int) -> None:
    """Validate a FlashAttention-style cu_seqlens against a [1, total, ...] packed input."""
    if cu_seqlens is None:
        return
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError("cu_seqlens must be a 1-D integer tensor")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (packed), got {batch}")
    if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != total:
        raise ValueError(f"cu_seqlens must start at 0 and end at the packed length {total}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def num_sequences(batch: int, cu_seqlens: torch.Tensor | None) -> int:
    return batch if cu_seqlens is None else cu_seqlens.numel() - 1


def seq_bounds(batch: int, seqlen: int, cu_seqlens: torch.Tensor | None) -> tuple[list[int], list[int]]:
    """(starts, lens): first token and length of each sequence in the flat [B * T] token rows.

    A [B, T] batch is B sequences of T tokens; a packed [1, sum(T)] batch is cut by `cu_seqlens`.
    Host-side lists: the ops loop over sequences in Python (one device sync here, not one per use).
    """
    if cu_seqlens is None:
        return [i * seqlen for i in range(batch)], [seqlen] * batch
    bounds = cu_seqlens.tolist()
    return bounds[:-1], [e - s for s, e in zip(bounds[:-1], bounds[1:])]


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """Accumulation dtype: fp64 when an input is fp64 (exact references, gradient checks), else fp32
    (never bf16: torch's bf16 matmul on CPU is slow, and states accumulate)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as fla and transformers compute it (in fp32)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def repeat_heads(x: torch.Tensor, num_heads: int, dim: int = 2) -> torch.Tensor:
    """Grouped heads: each of x's heads serves num_heads // x.shape[dim] consecutive heads."""
    h = x.shape[dim]
    if h == num_heads:
        return x
    if num_heads % h:
        raise ValueError(f"value heads ({num_heads}) must be a multiple of key heads ({h})")
    return x.repeat_interleave(num_heads // h, dim=dim)


def unpack(x: torch.Tensor, cu_seqlens: torch.Tensor, pad_value: float = 0.0) -> torch.Tensor:
    """[1, sum(T), *rest] -> right-padded [N, max(T), *rest]."""
    starts, lens = seq_bounds(1, x.shape[1], cu_seqlens)
    n, t_max = len(lens), max(lens, default=0)
    out = x.new_full((n, t_max, *x.shape[2:]), pad_value)
    for i, (s, n_i) in enumerate(zip(starts, lens)):
        out[i, :n_i] = x[0, s : s + n_i]
    return out


def pack(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Right-padded [N, max(T), *rest] -> [1, sum(T), *rest] (the inverse of `unpack`)."""
    _, lens = seq_bounds(1, 0, cu_seqlens)
    return torch.cat([x[i, :n] for i, n in enumerate(lens)], dim=0).unsqueeze(0)
