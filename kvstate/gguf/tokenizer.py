"""A GGUF file's tokenizer (`tokenizer.ggml.*`) as the tokenizer.json and tokenizer_config.json of a checkpoint.

llama.cpp stores a byte-level BPE ("gpt2" model) as its token list, merges and token types,
plus a pre-tokenizer name (`tokenizer.ggml.pre`) that stands for the split regex of the
original tokenizer.json; the regexes below are the ones llama.cpp's llama-vocab.cpp quotes from
those files. A SentencePiece BPE ("llama" model: Llama 2, Jamba, ...) is stored as pieces with scores
and no merges: llama.cpp's tokenizer merges the adjacent pair whose joined piece scores highest and
falls back to <0xNN> byte tokens; here that is a BPE whose merges are every split of every piece,
ranked by the piece's score (as transformers' GGUF reader builds it), with byte_fallback, "▁" for
spaces and, when `tokenizer.ggml.add_space_prefix` (the default) says so, one more "▁" before the text
and after each special token (Llama 2's tokenizer.json normalizer, which llama.cpp's own test vectors
of its SentencePiece vocabulary follow).
Unknown, control and user-defined tokens become added tokens (the first two special), as llama.cpp
matches them in the text. Torch-free.
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
# Kimi K2 and Kimi Linear's tiktoken pattern (tokenization_kimi.py; llama.cpp runs it as custom code):
# letters other than Han, Han runs on their own. Oniguruma reads the `&&` class intersections as tiktoken does.
_LETTERS = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_KIMI_K2 = "|".join((r"[\p{Han}]+",
                     rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS[0]}*{_LETTERS[1]}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS[0]}+{_LETTERS[1]}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
                     r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"))
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
# the pre-tokenizers llama.cpp runs as Llama 3's: a word that is a token is taken whole (`ignore_merges`), and
# BOS is added unless the file says otherwise
_LLAMA3_LIKE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "lfm2")
# tokenizer.ggml.pre -> split regex (None: the GPT-2 regex of ByteLevel itself)
PRE_TOKENIZERS = {"qwen2": _QWEN2, "qwen35": _QWEN35, "kimi-k2": _KIMI_K2, "gpt-2": None, "default": None,
                  **dict.fromkeys(_LLAMA3_LIKE, _LLAMA3)}
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # llama.cpp's token types (gguf.TokenType)
_SPACE = "\u2581"  # SentencePiece's "▁"
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


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


def _score_merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    """BPE merges of a SentencePiece vocabulary: each piece's splits into two pieces, best piece score first
    (ties: the better-scored halves first)."""
    score = dict(zip(tokens, scores))
    merges = []
    for piece, s in score.items():
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in score and right in score:
                merges.append((-s, -score[left], -score[right], left, right))
    merges.sort(key=lambda m: m[:3])  # stable: equal keys keep the vocabulary's order
    return [[left, right] for *_, left, right in merges]


def _model(reader, model: str, tokens: list[str], types: list[int]) -> dict[str, Any]:
    """(model, pre_tokenizer, decoder, post_processor) of tokenizer.json for a "gpt2" or "llama" model."""
    bpe = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
           "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
           "vocab": {tok: i for i, tok in enumerate(tokens)}}
    if model == "gpt2":
        merges = field(reader, "tokenizer.ggml.merges", [])
        whole = field(reader, "tokenizer.ggml.pre") in _LLAMA3_LIKE
        return {"model": {**bpe, "ignore_merges": whole, "merges": [m.split(" ", 1) for m in merges]},
                "pre_tokenizer": _pre_tokenizer(field(reader, "tokenizer.ggml.pre"), reader.source),
                "decoder": _BYTE_LEVEL, "post_processor": _BYTE_LEVEL}
    scores = field(reader, "tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise KvstateError(f"{reader.source}: GGUF tokenizer model 'llama' needs tokenizer.ggml.scores, one per token")
    unk = field(reader, "tokenizer.ggml.unknown_token_id")
    if unk is None and _UNKNOWN in types:
        unk = types.index(_UNKNOWN)
    prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    # llama.cpp puts a space before the text and after each special token, even where one is there already
    prepend = [{"type": "Prepend", "prepend": _SPACE}] if prefix else []
    decoders = [{"type": "Replace", "pattern": {"String": _SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if prefix else [])
    return {"model": {**bpe, "unk_token": tokens[unk] if unk is not None else None, "fuse_unk": True,
                      "byte_fallback": True, "merges": _score_merges(tokens, scores)},
            "normalizer": {"type": "Sequence", "normalizers": prepend + [
                {"type": "Replace", "pattern": {"String": " "}, "content": _SPACE}]}, "pre_tokenizer": None,
            "decoder": {"type": "Sequence", "decoders": decoders}, "post_processor": _bos_template(reader, tokens)}


def _bos_template(reader, tokens: list[str]) -> dict | None:
    """A post-processor that puts BOS first, even before a BOS the text spells (llama.cpp does so, as does
    the tokenizer.json transformers writes for a Llama tokenizer); None when the file adds none."""
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    if not field(reader, "tokenizer.ggml.add_bos_token", True) or bos is None or not 0 <= bos < len(tokens):
        return None
    first = [{"SpecialToken": {"id": tokens[bos], "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
    second = [{"SpecialToken": {"id": tokens[bos], "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]
    return {"type": "TemplateProcessing", "single": first, "pair": first + second,
            "special_tokens": {tokens[bos]: {"id": tokens[bos], "ids": [bos], "tokens": [tokens[bos]]}}}


def tokenizer_files(reader) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tokenizer.json, tokenizer_config.json) dicts of an open GGUF reader."""
    where = reader.source
    model = field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise KvstateError(f"{where}: GGUF tokenizer model {model!r} is not supported (supported: gpt2 byte-level "
                           "BPE, llama SentencePiece BPE)")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens")
    types: list[int] = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": kind != _USER_DEFINED} for i, (tok, kind) in enumerate(zip(tokens, types))
             if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED)]  # what llama.cpp matches in the text
    tokenizer = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
                 **_model(reader, model, tokens, types)}
    # llama.cpp's default: a SentencePiece vocabulary adds BOS, a byte-level BPE only with a Llama 3 pre-tokenizer
    bos_default = model == "llama" or field(reader, "tokenizer.ggml.pre") in _LLAMA3_LIKE
    config: dict[str, Any] = {"add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", bos_default))}
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
