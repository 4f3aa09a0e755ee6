"""A GGUF file rewritten with gguf's own GGUFWriter: every metadata field and tensor copied, with edits
(another architecture name, tensors dropped or stored in another type, matrices quantized)."""

from __future__ import annotations

import zlib

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

# where each block type keeps its fp16 scales (byte offsets) and how large a scale keeps weights below ~0.1
_SCALES = {"Q8_0": ((0,), 1e-3), "Q4_0": ((0,), 1e-2), "Q4_K": ((0, 2), 1e-4), "Q5_K": ((0, 2), 5e-5),
           "Q6_K": ((208,), 2e-5), "IQ4_NL": ((0,), 1e-3), "IQ4_XS": ((0,), 3e-5)}


def quantizable(tensor, qtype: GGMLQuantizationType | None = None, experts: bool = False) -> bool:
    """The projection and embedding matrices (what llama-quantize quantizes; not the conv kernels or a
    2-D norm such as Mamba-2's grouped one), rows a multiple of the block; with `experts`, the MoE
    expert tensors [E, N, K] (`*_exps`) too."""
    block = GGML_QUANT_SIZES[qtype][0] if qtype is not None else 32
    matrix = len(tensor.shape) == 2 or (experts and len(tensor.shape) == 3 and "_exps" in tensor.name)
    return (matrix and "conv1d" not in tensor.name and "norm" not in tensor.name
            and int(tensor.shape[0]) % block == 0)


def random_blocks(name: str, shape, qtype: GGMLQuantizationType) -> np.ndarray:
    """Random blocks for a [rows, K] matrix (K-quants: gguf has no quantizer; their meaning is its
    dequantizer's), the fp16 scales set to small finite values; the same bytes for the same name."""
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    raw = rng.integers(0, 256, size=(shape[0], shape[1] // block, nbytes), dtype=np.uint8)
    offsets, size = _SCALES[qtype.name]
    for off in offsets:
        scales = (rng.uniform(0.2, 1.0, size=raw.shape[:2]) * size).astype(np.float16)
        raw[:, :, off:off + 2] = scales[..., None].view(np.uint8)
    return raw.reshape(shape[0], -1)


def rewrite(src, dst, *, arch: str | None = None, drop=(), retype: dict | None = None,
            qtype: GGMLQuantizationType | None = None, dequantized: bool = False, keep=(), rounded=None,
            experts: bool = False):
    """`qtype`: the quantizable matrices (but those named in `keep`) stored in that type (random blocks
    for a type gguf cannot quantize); with `dequantized`, those (and the tensors the file already holds
    quantized) stored as F32 holding gguf's dequantization, rounded to bf16 (only those named in
    `rounded`, when given: what the loader dequantizes rather than keeps as blocks)."""
    reader = GGUFReader(str(src))
    old = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(dst), arch or old)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key.replace(f"{old}.", f"{arch or old}.", 1), field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if retype and t.name in retype:
            writer.add_tensor(t.name, data.astype(retype[t.name]))
        elif qtype is not None and quantizable(t, qtype, experts) and t.name not in keep:
            try:
                blocks = quantize(data, qtype)
            except NotImplementedError:
                blocks = random_blocks(t.name, data.shape, qtype)
            if dequantized:
                values = dequantize(blocks, qtype)
                writer.add_tensor(t.name, _bf16(values) if rounded is None or t.name in rounded else values)
            else:
                writer.add_tensor(t.name, blocks, raw_dtype=qtype)
        elif t.tensor_type.name not in ("F32", "F16", "BF16"):  # already quantized: its dequantization
            values = dequantize(data, t.tensor_type)
            if dequantized and (rounded is None or t.name in rounded):
                values = _bf16(values)
            writer.add_tensor(t.name, values if dequantized else data,
                              raw_dtype=None if dequantized else t.tensor_type)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _bf16(values: np.ndarray) -> np.ndarray:
    """fp32 values rounded to bf16 (what the loader keeps of a dequantized tensor), as fp32."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16).float().numpy()
