"""GGUF files (llama.cpp's format) wherever a model is accepted, read with the `gguf` package.

A GGUF file is one file holding what a Hugging Face checkpoint spreads over a folder: config
(metadata keys), tokenizer (`tokenizer.ggml.*`, `tokenizer.chat_template`) and weights (tensors
under llama.cpp's names, some transformed by its converter). kvstate reads it back into the
checkpoint's terms, so the plan, layers and tokenizer are those a safetensors checkpoint gets:
- `metadata.hf_config(path)`: the config.json dict (torch-free: `kvstate memory model.gguf`);
- `checkpoint.checkpoint_dir(path)`: a small folder (config.json, tokenizer files, and a link to
  the file) that the loader and tokenizer open like any checkpoint directory;
- `weights.hf_tensors(path, config)`: (HF name, tensor) pairs, the converter's transforms undone.
"""

from __future__ import annotations

import os
from pathlib import Path

GGUF_LINK = "model.gguf"  # the file's link inside its checkpoint folder


def is_gguf(path: str | os.PathLike) -> bool:
    """A path naming a GGUF file (by its suffix: the magic is checked when it is read)."""
    return Path(path).suffix.lower() == ".gguf"
