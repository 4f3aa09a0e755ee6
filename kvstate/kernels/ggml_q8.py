"""llama.cpp's arithmetic for GGML block weights, written plainly: the reference of the "q8" mode.

`set_activation_dtype("q8")` makes the compiled kernels (csrc/quant_q8*) quantize each x row as ggml
does for a weight type's `vec_dot_type` (ggml-cpu.c): Q8_0 and Q4_0 weights meet x in block_q8_0
(32 codes, fp16 d = amax / 127, `quantize_row_q8_0_ref`), the K-quants meet it in block_q8_K (256
codes, fp32 d = max / -127, the sum of each 16 codes, `quantize_row_q8_K_ref`); then each block's dot
product is an integer sum and the blocks' scales multiply it. Here the same steps run on whole arrays:
the x quantizers in float32 exactly as ggml rounds, the dot products in int64 (exact), the scales in
float64, so the kernels' outputs differ from `linear_q8` only by their fp32 sums.
"""

from __future__ import annotations

import numpy as np
import torch

from kvstate.kernels.ggml_blocks import TYPES, _k_nibbles, _scale_min_k4

X_TYPE = {"Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_K": "Q8_K", "Q5_K": "Q8_K", "Q6_K": "Q8_K"}  # vec_dot_type


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (d float16 [M, K/32], codes int8 [M, K/32, 32]), as gguf's Q8_0 quantizer."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 32, 32)
    d = np.abs(blocks).max(axis=2, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    a = np.abs(blocks * inv)
    q = np.sign(blocks) * (np.floor(a) + np.floor(2 * (a - np.floor(a))))  # roundf: halves away from zero
    return d[..., 0].astype(np.float16), q.astype(np.int8)


def quantize_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (d float32 [M, K/256], codes int8 [M, K/256, 256], bsums int16 [M, K/256, 16]),
    as quantize_row_q8_K_ref: max the first x of the largest |x|, iscale = -127 / max, codes rounded to
    nearest (ties to even), at most 127; d = 1 / iscale; an all-zero block is all zeros."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // 256, 256)
    first = np.abs(blocks).argmax(axis=2)[..., None]  # argmax: the first of equal values
    top = np.take_along_axis(blocks, first, axis=2)  # [M, nb, 1]
    zero = top == 0
    with np.errstate(divide="ignore"):
        iscale = np.where(zero, np.float32(0), np.float32(-127) / np.where(zero, np.float32(1), top)).astype(np.float32)
    q = np.minimum(np.rint(blocks * iscale), 127).astype(np.int8)
    with np.errstate(divide="ignore"):
        d = np.where(zero, np.float32(0), np.float32(1) / np.where(zero, np.float32(1), iscale)).astype(np.float32)
    bsums = q.reshape(m, k // 256, 16, 16).astype(np.int32).sum(axis=3).astype(np.int16)
    return d[..., 0], q, bsums


def x_bytes(x: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 [M, bytes]: x's blocks for `qtype` weights in ggml's layout (what the kernels' quantizer writes)."""
    m = x.shape[0]
    if X_TYPE[qtype] == "Q8_0":
        d, q = quantize_q8_0(x)
        parts = [d[..., None].view(np.uint8), q.view(np.uint8)]
    else:
        d, q, bs = quantize_q8_k(x)
        parts = [d[..., None].view(np.uint8), q.view(np.uint8), bs.view(np.uint8)]
    return np.concatenate(parts, axis=2).reshape(m, -1)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[R, 2] uint8 -> float64 [R]."""
    return b.contiguous().view(torch.float16)[:, 0].double()


def linear_q8(x: np.ndarray, raw: torch.Tensor, qtype: str) -> np.ndarray:
    """float64 y [M, N] = x [M, K] @ W^T the q8 way: W the `qtype` blocks `raw` [N, bytes per row]."""
    t = TYPES[qtype]
    n, nb = raw.shape[0], raw.shape[1] // t.nbytes
    b = raw.reshape(n * nb, t.nbytes)
    if X_TYPE[qtype] == "Q8_0":
        dx, qx = quantize_q8_0(x)
        qx = torch.from_numpy(qx.astype(np.int64))  # [M, nb, 32]
        if qtype == "Q8_0":
            codes = b[:, 2:].contiguous().view(torch.int8).long()
        else:
            qs = b[:, 2:].long()
            codes = torch.cat([qs & 15, qs >> 4], dim=1) - 8
        sumi = torch.einsum("mbk,nbk->mnb", qx, codes.reshape(n, nb, 32))
        scale = torch.from_numpy(dx.astype(np.float64))[:, None, :] * _f16(b[:, :2]).reshape(1, n, nb)
        return (scale * sumi.double()).sum(-1).numpy()
    dx, qx, bsums = quantize_q8_k(x)
    qx = torch.from_numpy(qx.astype(np.int64))
    dx = torch.from_numpy(dx.astype(np.float64))[:, None, :]  # [M, 1, nb]
    bsums = torch.from_numpy(bsums.astype(np.int64))  # [M, nb, 16]
    if qtype == "Q6_K":
        ql, qh = b[:, :128].long().reshape(-1, 2, 2, 32), b[:, 128:192].long().reshape(-1, 2, 1, 32)
        low = torch.cat([ql & 15, ql >> 4], dim=2)  # [R, half, 4, 32]: weights 128 half + 32 quarter + l
        high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
        codes = ((low | (high << 4)) - 32).reshape(n, nb, 16, 16)  # 16 codes per scale
        sc = b[:, 192:208].contiguous().view(torch.int8).long().reshape(n, nb, 16)
        sumi = torch.einsum("mbjk,nbjk,nbj->mnb", qx.reshape(-1, nb, 16, 16), codes, sc)
        return (dx * _f16(b[:, 208:]).reshape(1, n, nb) * sumi.double()).sum(-1).numpy()
    sc, mins = (v.long().reshape(n, nb, 8) for v in _scale_min_k4(b[:, 4:16]))
    codes = _k_nibbles(b[:, 48:] if qtype == "Q5_K" else b[:, 16:144]).long()  # [R, 8, 32]
    if qtype == "Q5_K":
        qh = b[:, 16:48].long()
        codes = codes | (torch.stack([(qh >> j) & 1 for j in range(8)], dim=1) << 4)
    sumi = torch.einsum("mbjk,nbjk,nbj->mnb", qx.reshape(-1, nb, 8, 32), codes.reshape(n, nb, 8, 32), sc)
    summ = torch.einsum("mbj,nbj->mnb", bsums.reshape(-1, nb, 8, 2).sum(-1), mins)
    d, dmin = _f16(b[:, 0:2]).reshape(1, n, nb), _f16(b[:, 2:4]).reshape(1, n, nb)
    return (dx * (d * sumi.double() - dmin * summ.double())).sum(-1).numpy()
