"""A GGUF file rewritten with gguf's own GGUFWriter: every metadata field and tensor copied, with edits
(another architecture name, tensors dropped or stored in another type, matrices quantized)."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize


def quantizable(tensor) -> bool:
    """The projection and embedding matrices (what llama-quantize quantizes; not the conv kernels)."""
    return len(tensor.shape) == 2 and "conv1d" not in tensor.name and int(tensor.shape[0]) % 32 == 0


def rewrite(src, dst, *, arch: str | None = None, drop=(), retype: dict | None = None,
            qtype: GGMLQuantizationType | None = None, dequantized: bool = False):
    """`qtype`: the quantizable matrices stored in that type; with `dequantized`, those (and the tensors
    the file already holds quantized) stored as F32 holding gguf's dequantization, rounded to bf16."""
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
        elif qtype is not None and quantizable(t):
            blocks = quantize(data, qtype)
            if dequantized:
                writer.add_tensor(t.name, _bf16(dequantize(blocks, qtype)))
            else:
                writer.add_tensor(t.name, blocks, raw_dtype=qtype)
        elif t.tensor_type.name not in ("F32", "F16", "BF16"):  # already quantized: its dequantization
            values = dequantize(data, t.tensor_type)
            writer.add_tensor(t.name, _bf16(values) if dequantized else data,
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
