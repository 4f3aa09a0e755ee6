"""Weights kept as GGML quantized blocks (a GGUF file's Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS), fp32 math.

`set_block_weight(linear, raw, qtype)` makes a `kernels.Linear` hold the rows of blocks exactly as a
GGUF file stores them (uint8 [N, bytes per row], ggml-common.h's layout) in place of its weight;
its forward then multiplies by exactly the weights they mean (`ggml_blocks.dequantize`, equal to
`gguf.quants.dequantize`): "exact by default", fp32 activations, no rounding of x. The state dict
holds the blocks under `weight` and the GGML type number under `weight_type`.

`block_linear` runs the compiled kernel (csrc/quant_*: AVX-512 or AVX2, each block dequantized
exactly in registers, FMAs with fp32 x) for up to `MAX_ROWS` rows, and otherwise (prefill, no
extension, `kernels.backend("torch")`) the GEMM path: it dequantizes a tile of rows at a time (the
compiled `quant_dequantize`, else torch ops; a few MiB of fp32, so the full fp32 matrix never
exists) and multiplies each tile with one fp32 GEMM. Both multiply by the same weights; only the
summation order differs. Under `activation.set_activation_dtype("bf16")` (the opt-in of llama.cpp's
precision) the compiled tiles and x are rounded to bf16 for torch's bf16 GEMM, as bf16 weights'
prefill does there. Under `set_activation_dtype("q8")` (llama.cpp's arithmetic) the kernel's rows of
Q8_0, Q4_0, Q4_K, Q5_K and Q6_K blocks (up to `MAX_ROWS`, one matrix or fused parts) take x quantized
to 8 bits per block and integer dot products (csrc/quant_q8*, `ggml_q8` its plain form); the prefill
GEMM path rounds x and the tiles to bf16 as under "bf16" (on AVX512_BF16 CPUs; fp32 elsewhere), and
IQ4_NL / IQ4_XS keep the exact kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvstate.kernels import _ext, activation
from kvstate.kernels.dispatch import MAX_ROWS_BF16, choice
from kvstate.kernels.ggml_blocks import TYPES, dequantize, row_bytes
from kvstate.profiling import timed

SUPPORTED: frozenset[str] = frozenset(TYPES)
TILE_WEIGHTS = 1 << 16  # fp32 weights dequantized per tile by torch (256 KiB)
TILE_WEIGHTS_COMPILED = 1 << 20  # by the compiled dequantizer: 4 MiB, a GEMM's worth for prefill
MAX_ROWS = MAX_ROWS_BF16  # the kernel reads each block once for all rows, like the bf16 path


def set_block_weight(linear: nn.Module, raw: torch.Tensor, qtype: str) -> None:
    """Store `raw` (uint8 [out N, bytes per row] of `qtype` blocks, each row as the file holds it) as
    `linear`'s weight; ValueError when the type or the shape does not fit the Linear [N, K]."""
    if qtype not in SUPPORTED:
        raise ValueError(f"{qtype} blocks are not supported (supported: {', '.join(sorted(SUPPORTED))})")
    n, k = linear.out_features, linear.in_features
    if k % TYPES[qtype].block:
        raise ValueError(f"{qtype} rows hold a multiple of {TYPES[qtype].block} weights; this Linear's rows "
                         f"have {k}")
    want = (n, row_bytes(qtype, k))
    if raw.dtype != torch.uint8 or tuple(raw.shape) != want:
        raise ValueError(f"{qtype} weight of a [{n}, {k}] Linear: expected uint8 {list(want)}, got "
                         f"{str(raw.dtype).removeprefix('torch.')} {list(raw.shape)}")
    linear.weight = nn.Parameter(raw.detach().contiguous(), requires_grad=False)
    linear.weight_scale = None
    linear.weight_format = qtype
    linear.register_buffer("weight_type", torch.tensor(TYPES[qtype].type_id, dtype=torch.int32))


@timed("linear")
def block_linear(x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None, qtype: str) -> torch.Tensor:
    """y[..., N] = x[..., K] @ W^T + bias, W the weights `raw` [N, bytes per row] means, fp32 math."""
    return _block_linear(x, raw, bias, qtype)


def _block_linear(x: torch.Tensor, raw: torch.Tensor, bias: torch.Tensor | None, qtype: str) -> torch.Tensor:
    n = raw.shape[0]
    k = row_weights(raw, qtype)
    x2 = x.reshape(-1, k).float()  # [M, K]
    isa = _isa(x2)
    if isa is not None:
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            bias = bias.float().contiguous()
        y = _ext.load().quant_linear(x2, raw, bias, TYPES[qtype].type_id, isa)
        return y.reshape(*x.shape[:-1], n).to(x.dtype)
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    deq = _dequantizer(x2)
    rows = max(1, (TILE_WEIGHTS if deq is dequantize else TILE_WEIGHTS_COMPILED) // k)
    bf16 = activation.blocks_bf16_gemm and deq is not dequantize  # the opt-in: x and the tiles in bf16
    xg = x2.to(torch.bfloat16) if bf16 else x2
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        w = deq(raw[start:stop], qtype)
        y[:, start:stop] = F.linear(xg, w.to(torch.bfloat16)).float() if bf16 else F.linear(x2, w)
    if bias is not None:
        y += bias.float()
    return y.reshape(*x.shape[:-1], n).to(x.dtype)


@timed("linear")
def block_parts_linear(x: torch.Tensor, raws: list[torch.Tensor], qtypes: tuple[str, ...]) -> torch.Tensor:
    """torch.cat([block_linear(x, raw, None, qtype) ...], -1): several block matrices of one input, each
    of its own type, as one compiled call where the kernel serves x (decode), else one by one."""
    k = row_weights(raws[0], qtypes[0])
    x2 = x.reshape(-1, k).float()  # [M, K]
    isa = _isa(x2)
    if isa is None or not hasattr(_ext.load(), "quant_linear_parts"):
        return torch.cat([_block_linear(x, raw, None, q) for raw, q in zip(raws, qtypes)], -1)
    y = _ext.load().quant_linear_parts(x2, raws, [TYPES[q].type_id for q in qtypes], isa)
    return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


def block_rows(raw: torch.Tensor, ids: torch.Tensor, qtype: str) -> torch.Tensor:
    """fp32 [len(ids), K]: rows `ids` of the weights `raw` [N, bytes per row] means (an embedding
    table kept as blocks: only the rows looked up are dequantized)."""
    rows = raw.index_select(0, ids.reshape(-1))
    return _dequantizer(rows)(rows, qtype) if rows.shape[0] else torch.empty(0, row_weights(raw, qtype))


def row_weights(raw: torch.Tensor, qtype: str) -> int:
    """Weights per row of blocks `raw` [N, bytes per row]."""
    return raw.shape[1] // TYPES[qtype].nbytes * TYPES[qtype].block


def _dequantizer(x2: torch.Tensor):
    """The compiled dequantizer (the same weights, one call per tile) where the kernels run, else torch's."""
    ext = _ext.load() if choice() != "torch" and x2.is_cpu else None
    if ext is None or not hasattr(ext, "quant_dequantize"):
        return dequantize
    return lambda raw, qtype: ext.quant_dequantize(raw, TYPES[qtype].type_id)


def _isa(x2: torch.Tensor) -> str | None:
    """The ISA the compiled kernel runs for x [M, K] (the backend's, within the KVSTATE_KERNELS cap;
    AMX's calls go to AVX-512), or None for the torch path."""
    chosen = choice()
    if chosen == "torch" or x2.shape[0] > MAX_ROWS or not x2.is_cpu or x2.dtype != torch.float32:
        return None
    if torch.is_grad_enabled() and x2.requires_grad:
        return None
    ext = _ext.load()
    if ext is None or not hasattr(ext, "quant_linear"):
        return None
    if chosen in ("avx512", "avx2"):
        return chosen  # (the kernel says so when this CPU lacks it)
    have = [i for i in ext.isas() if i != "amx" and (ext.isa_cap() != "avx2" or i == "avx2")]
    return have[0] if have else None
