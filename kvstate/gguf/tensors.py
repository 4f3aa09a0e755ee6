"""A GGUF file's tensor table, kept in its checkpoint folder so a load need not parse the metadata again.

`gguf.GGUFReader` parses every metadata field when it opens a file: 12-20 s on these machines for
a 248k-token vocabulary and its merges (a real Qwen3.5 file), all to find where the tensors lie.
The checkpoint folder (`checkpoint.checkpoint_dir`) is written once from such a reader; it also
keeps each tensor's name, type, shape and offset (`tensors.json`). `open_tensors` reads the table
back and maps the file itself: each `Tensor` has the fields of gguf's `ReaderTensor` the loader
uses, with `data` the same numpy view gguf would give (memory-mapped, read-only). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TABLE = "tensors.json"
_ITEM = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}


def table_of(reader) -> list[list]:
    """[name, GGML type number, shape (innermost first, as GGUF lists it), byte offset in the file] per tensor."""
    return [[t.name, int(t.tensor_type), [int(d) for d in t.shape], int(t.data_offset)] for t in reader.tensors]


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: list[int]  # innermost first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class TensorTable:
    """A reader's `tensors` (and `source`) from the table in `folder`, over the file `path`."""

    def __init__(self, path: Path, rows: list[list]):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.source = path
        whole = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors = []
        for name, type_id, shape, offset in rows:
            qtype = GGMLQuantizationType(type_id)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(shape)) if shape else 1
            n_bytes = n * size // block
            dims = tuple(reversed(shape))
            raw = whole[offset:offset + n_bytes]
            if raw.size != n_bytes:
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            if qtype.name in _ITEM:
                data = raw.view(_ITEM[qtype.name]).reshape(dims)
            else:  # BF16 and the quantized types: bytes, the innermost dimension in bytes (as gguf gives them)
                data = raw.reshape(quant_shape_to_byte_shape(dims, qtype))
            self.tensors.append(Tensor(name, qtype, list(shape), n, n_bytes, offset, data))


def write_table(reader, folder: Path) -> None:
    (folder / TABLE).write_text(json.dumps(table_of(reader)))


def open_tensors(link: Path) -> TensorTable | None:
    """The table of the checkpoint folder holding `link` (its link to the GGUF file), or None when the
    folder has none (written by an older kvstate)."""
    table = link.parent / TABLE
    if not table.is_file():
        return None
    return TensorTable(link.resolve(), json.loads(table.read_text()))
