"""Quantize fp32 rows into GGML blocks (Q8_0, Q4_0, Q4_K), byte for byte as ggml does, in torch.

`quantize(w, qtype)` -> uint8 [N, bytes per row], the blocks a GGUF file would hold for w (K a
multiple of the block size). Q8_0 and Q4_0 follow ggml's reference rounding (the same bytes as
`gguf.quants.quantize`); Q4_K follows `quantize_row_q4_K_ref` (ggml-quants.c): per 32-weight
sub-block an asymmetric 4-bit fit that searches 21 scales by weighted least squares, the scales and
mins then quantized to 6 bits against the block's largest. Its float sums run in the reference's
order (one weight at a time), since a different order may pick a different scale on a tie.
"""

from __future__ import annotations

import torch

from kvstate.kernels.ggml_blocks import TYPES


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 [R] -> uint8 [R, 2] (its fp16, little-endian)."""
    return v.to(torch.float16).reshape(-1, 1).view(torch.uint8)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf, as ggml's reference (and gguf's np_roundf) compute it."""
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _q8_0(x: torch.Tensor) -> torch.Tensor:  # x [R, 32] -> [R, 34]
    d = x.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    qs = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d), qs], dim=1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:  # x [R, 32] -> [R, 18]
    signed_max = x.gather(1, x.abs().argmax(dim=1, keepdim=True))  # the largest magnitude, with its sign
    d = signed_max / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    qs = torch.trunc(x * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d), qs[:, :16] | (qs[:, 16:] << 4)], dim=1)


def _fit_4bit(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """make_qkx2_quants(32, 15, x, w, rmin=-1, rdelta=0.1, nstep=20): x, w [S, 32] -> (scale, -min) [S]
    and the codes [S, 32] of the best fit."""
    cols = x.unbind(1)
    wcols = w.unbind(1)
    lo, hi = x.amin(dim=1).clamp(max=0), x.amax(dim=1)
    sum_w, sum_x = wcols[0].clone(), wcols[0] * cols[0]
    for i in range(1, 32):
        sum_w = sum_w + wcols[i]
        sum_x = sum_x + wcols[i] * cols[i]
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)

    def codes(iscale, mn):
        return [torch.round(iscale * (c - mn)).clamp(0, 15) for c in cols]

    def error(scale, mn, levels):
        err = torch.zeros_like(lo)
        for c, wc, lv in zip(cols, wcols, levels):
            diff = scale * lv + mn - c
            err = err + wc * (diff * diff)
        return err

    iscale = 15 / span
    scale, mn = 1 / iscale, lo
    levels = codes(iscale, mn)
    best, best_levels = error(scale, mn, levels), torch.stack(levels, 1)
    for step in range(21):
        # rmin + rdelta * step + nmax in float32, as the reference computes it
        # the reference moves the offset to each better fit's min as it goes
        span = torch.where(flat, torch.ones_like(hi), hi - mn)
        levels = codes((torch.tensor(-1.0) + torch.tensor(0.1) * step + 15) / span, mn)
        sum_l = torch.zeros_like(lo)
        sum_l2, sum_xl = torch.zeros_like(lo), torch.zeros_like(lo)
        for c, wc, lv in zip(cols, wcols, levels):
            wl = wc * lv
            sum_l, sum_l2, sum_xl = sum_l + wl, sum_l2 + wl * lv, sum_xl + wl * c
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = torch.where(ok, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 == 0, torch.ones_like(sum_l2), sum_l2), this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, levels)
        better = ok & (cur < best)
        best = torch.where(better, cur, best)
        scale, mn = torch.where(better, this_scale, scale), torch.where(better, this_min, mn)
        best_levels = torch.where(better[:, None], torch.stack(levels, 1), best_levels)
    zero = torch.zeros_like(scale)
    return (torch.where(flat, zero, scale), torch.where(flat, -lo, -mn),
            torch.where(flat[:, None], torch.zeros_like(best_levels), best_levels))


def _q4_k(x: torch.Tensor) -> torch.Tensor:  # x [R, 256] -> [R, 144]
    r = x.shape[0]
    sub = x.reshape(r * 8, 32)
    sum_x2 = torch.zeros(r * 8)
    for c in sub.unbind(1):
        sum_x2 = sum_x2 + c * c
    weights = torch.sqrt(sum_x2 / 32)[:, None] + sub.abs()
    scales, mins, fit = _fit_4bit(sub, weights)
    scales, mins = scales.reshape(r, 8), mins.reshape(r, 8)
    # the largest positive one, else +0 (not a -0.0 min: its fp16 bytes would differ)
    max_scale, max_min = (torch.where(t.amax(dim=1) > 0, t.amax(dim=1), 0.0) for t in (scales, mins))
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), 0)
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), 0)
    # nearest_int into a uint8, then at most 63 (the reference's order: a negative code wraps first)
    ls = (torch.round(inv_scale[:, None] * scales).to(torch.int64) & 0xFF).clamp(max=63)
    lm = (torch.round(inv_min[:, None] * mins).to(torch.int64) & 0xFF).clamp(max=63)
    packed = torch.zeros(r, 12, dtype=torch.int64)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    d16, dmin16 = (max_scale / 63).to(torch.float16), (max_min / 63).to(torch.float16)
    d = d16.float()[:, None] * ls.float()  # [R, 8]
    dm = dmin16.float()[:, None] * lm.float()
    safe = torch.where(d == 0, torch.ones_like(d), d)
    levels = torch.round((x.reshape(r, 8, 32) + dm[:, :, None]) / safe[:, :, None]).clamp(0, 15)
    # a sub-block whose scale rounds to 0 keeps the fit's codes (they multiply 0: any would do)
    levels = torch.where((d == 0)[:, :, None], fit.reshape(r, 8, 32), levels).to(torch.uint8)
    pairs = levels.reshape(r, 4, 2, 32)
    qs = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(r, 128)
    return torch.cat([d16.reshape(-1, 1).view(torch.uint8), dmin16.reshape(-1, 1).view(torch.uint8),
                      packed.to(torch.uint8), qs], dim=1)


_QUANT = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k}
QUANTIZABLE = frozenset(_QUANT)


def quantize(w: torch.Tensor, qtype: str, rows_per_chunk: int = 256) -> torch.Tensor:
    """w [N, K] (any float dtype; K a multiple of the block size) -> uint8 [N, bytes per row] of `qtype` blocks."""
    t = TYPES[qtype]
    n, k = w.shape
    if k % t.block:
        raise ValueError(f"{qtype} rows hold a multiple of {t.block} weights, not {k}")
    out = torch.empty(n, k // t.block * t.nbytes, dtype=torch.uint8)
    for start in range(0, n, rows_per_chunk):  # bounded temporaries (Q4_K's fit holds ~60 copies of the chunk)
        chunk = w[start:start + rows_per_chunk].detach().float().reshape(-1, t.block)
        out[start:start + rows_per_chunk] = _QUANT[qtype](chunk).reshape(-1, out.shape[1])
    return out
