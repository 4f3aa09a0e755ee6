"""GGML's quantized block formats (ggml-common.h), read in torch: sizes and exact dequantization.

A GGUF file stores each row of a quantized matrix as consecutive blocks; a block holds the codes of
32 (Q8_0, Q4_0, IQ4_NL) or 256 (the K-quants, IQ4_XS) weights and the fp16 scales they share. `dequantize`
turns rows of raw blocks (uint8 [N, bytes per row]) into the exact fp32 weights the format means,
with the products in the order ggml's own dequantizer takes them (d * sc first, then times the
code), so the result equals `gguf.quants.dequantize` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockType:
    name: str
    type_id: int  # GGML_TYPE_* (ggml.h; the number a GGUF tensor header carries)
    block: int  # weights per block
    nbytes: int  # bytes per block


TYPES = {t.name: t for t in (
    BlockType("Q4_0", 2, 32, 18),
    BlockType("Q8_0", 8, 32, 34),
    BlockType("Q4_K", 12, 256, 144),
    BlockType("Q5_K", 13, 256, 176),
    BlockType("Q6_K", 14, 256, 210),
    BlockType("IQ4_NL", 20, 32, 18),
    BlockType("IQ4_XS", 23, 256, 136),
)}
# the 16 non-uniform levels of IQ4_NL and IQ4_XS (ggml-common.h kvalues_iq4nl)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
BY_ID = {t.type_id: t for t in TYPES.values()}


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of `k` weights (k a multiple of the block size, else ValueError)."""
    t = TYPES[qtype]
    if k % t.block:
        raise ValueError(f"{qtype} rows hold a multiple of {t.block} weights, not {k}")
    return k // t.block * t.nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 (little-endian fp16) -> [..., 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _q8_0(b):  # [R, 34]: d, qs[32]
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b):  # [R, 18]: d, qs[16]; weight j < 16 in the low nibble of qs[j], j >= 16 in the high one of qs[j-16]
    qs = b[:, 2:]
    q = torch.cat([qs & 0xF, qs >> 4], dim=1).to(torch.int8) - 8
    return q.float() * _f16(b[:, :2])


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of a K-quant block [R, 12] -> 6-bit (scale, min) of its 8 sub-blocks, [R, 8] each."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], 1).float(), torch.cat([lo_m, hi_m], 1).float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [R, 128] -> codes [R, 8, 32]: each 32 bytes hold sub-block 2c (low nibbles) and 2c+1 (high)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0xF, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b):  # [R, 144]: d, dmin, scales[12], qs[128]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    q = _k_nibbles(b[:, 16:]).float()
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(-1, 256)


def _q5_k(b):  # [R, 176]: d, dmin, scales[12], qh[32], qs[128]; bit j of qh[l] is the 5th bit of sub-block j's l
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, m = _scale_min_k4(b[:, 4:16])
    qh = b[:, 16:48]
    high = torch.stack([(qh >> j) & 1 for j in range(8)], dim=1)  # [R, 8, 32]
    q = (_k_nibbles(b[:, 48:]) | (high << 4)).float()
    return ((d * sc)[:, :, None] * q - (dmin * m)[:, :, None]).reshape(-1, 256)


def _q6_k(b):  # [R, 210]: ql[128], qh[64], scales int8[16], d
    ql = b[:, :128].reshape(-1, 2, 2, 32)  # [R, half, ql part, l]
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float().reshape(-1, 2, 8)  # 8 scales per half
    d = _f16(b[:, 208:210])
    low = torch.cat([ql & 0xF, ql >> 4], dim=2)  # [R, 2, 4, 32]: quarters 0..3 of each half
    high = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
    q = ((low | (high << 4)).to(torch.int8) - 32).float().reshape(-1, 2, 4, 2, 16)  # sixteens share a scale
    scale = (d[:, :, None] * sc).reshape(-1, 2, 4, 2, 1)  # scale index 2*quarter + l // 16
    return (scale * q).reshape(-1, 256)


def _iq4_codes(qs: torch.Tensor) -> torch.Tensor:
    """qs [R, 16] -> levels [R, 32] as floats: weight j < 16 from the low nibble of qs[j], j >= 16 the high one."""
    levels = torch.tensor(IQ4_LEVELS, dtype=torch.float32)
    return levels[torch.cat([qs & 0xF, qs >> 4], dim=1).long()]


def _iq4_nl(b):  # [R, 18]: d, qs[16]
    return _f16(b[:, :2]) * _iq4_codes(b[:, 2:])


def _iq4_xs(b):  # [R, 136]: d, scales_h (u16), scales_l[4], qs[128]; sub-block j's 6-bit scale ls, dl = d * (ls - 32)
    d = _f16(b[:, 0:2])
    high = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [R, 1]
    low = b[:, 4:8].to(torch.int32)
    j = torch.arange(8)
    ls = ((low[:, j // 2] >> (4 * (j % 2))) & 0xF) | (((high >> (2 * j)) & 3) << 4)  # [R, 8]
    dl = d * (ls - 32).float()
    q = _iq4_codes(b[:, 8:].reshape(-1, 16)).reshape(-1, 8, 32)
    return (dl[:, :, None] * q).reshape(-1, 256)


_DEQUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_NL": _iq4_nl,
            "IQ4_XS": _iq4_xs}


def dequantize(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """raw uint8 [N, bytes per row] of `qtype` blocks -> float32 [N, K] (the weights they mean)."""
    t = TYPES[qtype]
    n, nb = raw.shape[0], raw.shape[1] // t.nbytes
    if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[1] % t.nbytes:
        raise ValueError(f"{qtype} rows: expected uint8 [N, a multiple of {t.nbytes} bytes], got "
                         f"{raw.dtype} {tuple(raw.shape)}")
    return _DEQUANT[qtype](raw.reshape(n * nb, t.nbytes)).reshape(n, nb * t.block)
