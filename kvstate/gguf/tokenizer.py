"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as the tokenizer.json and tokenizer_config.json of a checkpoint.

llama.cpp stores a byte-level BPE ("gpt2" model) as its token list, merges and token types,
plus a pre-tokenizer name (`tokenizer.ggml.pre`) that stands for the split regex of the
original tokenizer.json; the regexes below are the ones llama.cpp's llama-vocab.cpp quotes from
those files. Control and user-defined tokens become added (special) tokens. Torch-free.
"""

from __future__ import annotations

import json
from typing import Any

from kvstate.errors import KvstateError
from kvstate.gguf.metadata import field

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex (None: the GPT-2 regex of ByteLevel itself)
PRE_TOKENIZERS = {"qwen2": _QWEN2, "qwen35": _QWEN35, "gpt-2": None, "default": None}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types that are added tokens


def _pre_tokenizer(pre: str | None, where) -> dict:
    key = pre or "default"
    if key not in PRE_TOKENIZERS:
        raise KvstateError(f"{where}: GGUF tokenizer pre-tokenizer {pre!r} is not supported "
                           f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    regex = PRE_TOKENIZERS[key]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": regex is None}
    if regex is None:
        return byte_level
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, byte_level]}


def tokenizer_files(reader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) dicts of an open GGUF reader."""
    where = reader.source
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise KvstateError(f"{where}: GGUF tokenizer model {model!r} is not supported (supported: gpt2 byte-level BPE)")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges: list[str] = field(reader, "tokenizer.ggml.merges", [])
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind == _CONTROL} for i, (tok, kind) in enumerate(zip(tokens, types))
             if kind in (_CONTROL, _USER_DEFINED)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": _pre_tokenizer(field(reader, "tokenizer.ggml.pre"), where),
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }
    config: dict[str, Any] = {"add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False))}
    for key in ("bos", "eos"):
        tid = field(reader, f"tokenizer.ggml.{key}_token_id")
        if tid is not None and 0 <= tid < len(tokens):
            config[f"{key}_token"] = tokens[tid]
    if (template := field(reader, "tokenizer.chat_template")) is not None:
        config["chat_template"] = template
    return tokenizer, config


def write_tokenizer(reader, folder) -> None:
    """tokenizer.json and tokenizer_config.json of the GGUF file into `folder`."""
    tokenizer, config = tokenizer_files(reader)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
