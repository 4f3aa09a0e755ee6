"""A GGUF file's tensors under their checkpoint names, with llama.cpp's converter transforms undone.

The converter (conversion/qwen.py) renames every tensor and, for Qwen3.5 and Qwen3-Next, also: stores
`-exp(A_log)` as `ssm_a`; adds 1 to the zero-centred RMSNorm weights (not the gated DeltaNet
norm); squeezes the conv1d weight to [channels, width]; splits Qwen3-Next's in_proj_qkvz into
[q | k | v] and z (the separate projections Qwen3.5 has, which its adapter takes); and, for Qwen3.5 with
more value heads than key heads, reorders the value heads from grouped-by-key-head to tiled (rows of the qkv, z,
a, b projections, A and dt_bias, the conv's value channels, the out projection's columns). Each
is inverted here, so the family adapter maps the result like the safetensors checkpoint (merged
expert tensors are split back into one tensor per expert). Mamba-2's converter stores A the same
way, A and D as [heads, 1] and the gated norm as [groups, inner / groups] (Falcon-H1's too, its muP
multipliers folded into the weights, which the config read back leaves at 1); Nemotron-H's also permutes
q and k rows. LFM2's, Jamba's and Kimi Linear's only reshape their conv weights (and store A as above,
in the checkpoint's shape); Kimi Linear's MLA kv_b_proj is split in two (joined back here). Names:
`kvstate.gguf.names`.
F32, F16 and BF16 tensors keep their dtype. A matrix of a block type kvstate multiplies
(`kernels.blocks.SUPPORTED`) that the loader keeps as blocks comes as `Blocks`: the file's raw rows,
the transforms done on whole rows (and, for the out projection's columns, on whole blocks, or where a
head is narrower than a block, not at all: the projection then permutes its input, `input_order`); any other
quantized tensor is dequantized with gguf's own `dequantize` to bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvstate.errors import KvstateError
from kvstate.gguf.metadata import check_tensor_types, matrix_dtype_name, open_reader
from kvstate.gguf.names import MAMBA_ARCHS, hf_name

_RAW = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DEQUANT_ROWS = 4096

def _tiled_to_grouped(t: torch.Tensor, dim: int, k_heads: int, per_k: int, head_dim: int) -> torch.Tensor:
    """Inverse of the converter's `_reorder_v_heads`: [per_k, k_heads, head_dim] back to [k_heads, per_k, head_dim]."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_k, k_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


@dataclass
class Blocks:
    """A quantized matrix as the file's rows of blocks: raw uint8 [N, bytes per row] of `qtype` (a GGML
    type name; `kernels.ggml_blocks.dequantize` gives the weights they mean)."""

    raw: torch.Tensor
    qtype: str


def _block(qtype: str) -> tuple[int, int]:
    """(weights, bytes) of one block of the GGML type named `qtype` (gguf's table)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def _reordered_columns(name: str, cfg: dict[str, Any]) -> bool:
    """Whether undoing the converter permutes this tensor's columns (Qwen3.5's GDN out projection)."""
    return (name.endswith("linear_attn.out_proj.weight") and cfg["gguf_architecture"] in ("qwen35", "qwen35moe")
            and cfg["linear_num_key_heads"] != cfg["linear_num_value_heads"])


def input_order(name: str, cfg: dict[str, Any], qtype: str) -> torch.Tensor | None:
    """For `qtype` blocks of `name` whose reordered columns cannot move as whole blocks (a value head
    narrower than the block: Qwen3.5-35B-A3B's heads of 128 in Q4_K), the blocks stay in the file's
    column order and the projection reads its input in that order: `perm` [K] with
    W_file[:, j] = W[:, perm[j]], so W @ x = W_file @ x[perm]. None where the columns move at load."""
    if not _reordered_columns(name, cfg) or cfg["linear_value_head_dim"] % _block(qtype)[0] == 0:
        return None
    k_heads, v_heads, dv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    file_of = _tiled_to_grouped(torch.arange(v_heads * dv), 0, k_heads, v_heads // k_heads, dv)  # [K]: file column
    return torch.argsort(file_of)


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of the converter's `LlamaModel.permute` (rows of each head from halves to interleaved pairs),
    which Nemotron-H's q and k get although its attention has no rotary embedding."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def undo_transforms(name: str, t: torch.Tensor, cfg: dict[str, Any], qtype: str | None = None) -> torch.Tensor:
    """The checkpoint's tensor from the converter's, for the checkpoint name `name`; with `qtype`, `t` is
    rows of that type's blocks (uint8 [N, bytes per row]: see `input_order`)."""
    arch = cfg["gguf_architecture"]
    if name.endswith("A_log"):
        t = torch.log(-t.float())
    if arch in ("lfm2", "jamba", "kimi-linear"):  # else only conv weights reshaped, which the loader takes as they are
        return t
    if arch in MAMBA_ARCHS:  # A, D stored [heads, 1], the gated norm [groups, inner / groups]
        if arch != "falcon-h1" and name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            heads = cfg["num_attention_heads"] if ".q_proj." in name else cfg["num_key_value_heads"]
            return _unpermute(t, heads)
        return t.reshape(-1) if name.endswith(("A_log", ".D", "mixer.norm.weight", "mamba.norm.weight")) else t
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t.float() - 1
    k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if k_heads == v_heads or ".linear_attn." not in name or cfg["gguf_architecture"] == "qwen3next":
        return t  # qwen3next's converter keeps the grouped order
    per_k, dk, dv = v_heads // k_heads, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
        qk = 2 * k_heads * dk
        return torch.cat([t[:qk], _tiled_to_grouped(t[qk:], 0, k_heads, per_k, dv)])
    if name.endswith("in_proj_z.weight"):
        return _tiled_to_grouped(t, 0, k_heads, per_k, dv)
    if name.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
        return _tiled_to_grouped(t, 0, k_heads, per_k, 1)
    if name.endswith("out_proj.weight"):
        if qtype is not None and input_order(name, cfg, qtype) is not None:
            return t  # the file's column order: the projection permutes its input instead
        width = dv if qtype is None else dv // _block(qtype)[0] * _block(qtype)[1]  # a head's bytes
        return _tiled_to_grouped(t, 1, k_heads, per_k, width)
    return t


def to_torch(tensor, path) -> torch.Tensor:
    """A ReaderTensor as a torch tensor in its own dtype (quantized types: dequantized, bfloat16)."""
    kind = tensor.tensor_type.name
    if kind in _RAW:
        data = np.asarray(tensor.data)
        if kind == "BF16":  # gguf hands BF16 as raw uint8/uint16; reinterpret the bytes
            return torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(_shape(tensor))
        return torch.from_numpy(data.copy()).reshape(_shape(tensor))
    from gguf.quants import dequantize

    # a few thousand rows at a time: no fp32 copy of a whole embedding table
    rows = np.asarray(tensor.data).reshape(-1, tensor.data.shape[-1])
    block, nbytes = _block(kind)
    out = torch.empty(rows.shape[0], rows.shape[1] // nbytes * block, dtype=torch.bfloat16)
    for start in range(0, rows.shape[0], DEQUANT_ROWS):
        out[start:start + DEQUANT_ROWS] = torch.from_numpy(dequantize(rows[start:start + DEQUANT_ROWS],
                                                                      tensor.tensor_type))
    return out.reshape(_shape(tensor))


def _shape(tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dimension first


def is_quantized(tensor) -> bool:
    return tensor.tensor_type.name not in _RAW


def reader_of(source):
    """An open reader for `source`, a GGUF file's path or a reader already open (opening one parses every
    metadata field: seconds for a 248k-token vocabulary, so a load opens the file once)."""
    return source if hasattr(source, "tensors") else open_reader(Path(source).resolve())


def matrix_dtype(source, kept: frozenset[str] = frozenset()) -> torch.dtype:
    """bfloat16 when the file's matrices are mostly 16-bit or quantized (kept as bf16), else float32;
    the matrices named in `kept` (held as blocks) do not count. `source`: a path or an open reader."""
    return torch.float32 if matrix_dtype_name(reader_of(source), kept) == "float32" else torch.bfloat16


def tensor_types(source, cfg: dict[str, Any]) -> Iterator[tuple[str, str, str, tuple[int, ...]]]:
    """(GGUF name, checkpoint name, GGML type name, shape) of each tensor, from the headers alone
    (expert tensors keep their `{e}` pattern); an unknown name is one KvstateError."""
    reader = reader_of(source)
    for t in reader.tensors:
        name = hf_name(t.name, cfg["gguf_architecture"])
        if name is None:
            raise KvstateError(f"{reader.source}: tensor {t.name!r} is not part of a {cfg['gguf_architecture']} model")
        yield t.name, name, t.tensor_type.name, _shape(t)


def _raw_rows(tensor) -> torch.Tensor:
    """A 2-D quantized tensor's bytes as uint8 [rows, bytes per row] (gguf hands them so shaped)."""
    data = np.asarray(tensor.data)
    return torch.from_numpy(data.reshape(data.shape[0], -1).copy())


def _kv_b(halves: tuple[dict, dict]) -> Iterator[tuple[str, torch.Tensor]]:
    """kv_b_proj of each layer whose k_b and v_b are both read: the inverse of the converter's split, k_b
    [heads, kv_lora, nope] transposed back and v_b [heads, v, kv_lora] put after it, head by head."""
    k_halves, v_halves = halves
    for prefix in [p for p in k_halves if p in v_halves]:
        k_b, v_b = k_halves.pop(prefix), v_halves.pop(prefix)
        kv_b = torch.cat([k_b.transpose(1, 2), v_b.to(k_b.dtype)], dim=1)  # [heads, nope + v, kv_lora]
        yield f"{prefix}kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])


def hf_tensors(source, cfg: dict[str, Any], blocks: frozenset[str] = frozenset()) -> Iterator[tuple[str, Any]]:
    """(checkpoint name, tensor) of each tensor of the GGUF file `source` (a path or an open reader): a
    `Blocks` for those named in `blocks` (GGUF names), else a torch tensor; an unknown name is one KvstateError."""
    reader = reader_of(source)
    path = reader.source
    check_tensor_types(reader)  # before any work: a type nothing reads fails the load at once
    halves: tuple[dict, dict] = ({}, {})  # MLA k_b and v_b, by their layer's prefix, till both are read
    for tensor in reader.tensors:
        name = hf_name(tensor.name, cfg["gguf_architecture"])
        if name is None:
            raise KvstateError(f"{path}: tensor {tensor.name!r} is not part of a {cfg['gguf_architecture']} model")
        if tensor.name in blocks:
            qtype = tensor.tensor_type.name
            if "{e}" in name:  # experts [E, N, K]: each expert's rows of blocks
                raw = torch.from_numpy(np.asarray(tensor.data).copy()).reshape(*_shape(tensor)[:2], -1)
                for e in range(raw.shape[0]):
                    yield name.format(e=e), Blocks(undo_transforms(name.format(e=e), raw[e], cfg, qtype), qtype)
                continue
            yield name, Blocks(undo_transforms(name, _raw_rows(tensor), cfg, qtype), qtype)
            continue
        data = undo_transforms(name, to_torch(tensor, path), cfg)
        if name.endswith(("self_attn.k_b_proj.weight", "self_attn.v_b_proj.weight")):  # Kimi Linear's MLA
            halves[name.endswith("v_b_proj.weight")][name[:-len("k_b_proj.weight")]] = data
            yield from _kv_b(halves)
        elif "{e}" in name:
            for e in range(data.shape[0]):
                yield name.format(e=e), data[e]
        else:
            yield name, data
