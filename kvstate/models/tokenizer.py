"""Tokenizer and chat template of a checkpoint: tokenizer.json through `tokenizers`, templates through jinja2.

The chat template comes from tokenizer_config.json's `chat_template` (a string, or a list of
named templates) or a chat_template.jinja file, rendered the way transformers renders it
(trim_blocks, lstrip_blocks, `raise_exception`, `tojson`). End-of-sequence ids are gathered
from generation_config.json, config.json and the tokenizer's eos token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvstate.errors import KvstateError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise KvstateError(f"{path}: malformed JSON ({exc})") from None


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise KvstateError(f"{path}: no tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises a bare Exception for unreadable or malformed files
            raise KvstateError(f"{file}: not a valid tokenizer.json ({str(exc).splitlines()[0][:120]})") from None
        cfg = _read_json(path / "tokenizer_config.json")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.pad_token = _token_text(cfg.get("pad_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        self.chat_template: str | None = template
        self.eos_token_ids = self._eos_ids(path)

    def _eos_ids(self, path: Path) -> set[int]:
        ids: set[int] = set()
        for source in (_read_json(path / "generation_config.json"), _read_json(path / "config.json")):
            value = source.get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
        if self.eos_token is not None and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            ids.add(tid)
        return ids

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def unk_id(self) -> int | None:
        """Id of the unknown token (a word-level tokenizer's `<unk>`), or None: byte-level BPE has none."""
        unk = getattr(self._tok.model, "unk_token", None)
        return None if unk is None else self._tok.token_to_id(unk)

    def unknown_words(self, text: str) -> list[str]:
        """The pieces of `text` this tokenizer turns into its unknown token, in order."""
        unk = self.unk_id
        if unk is None:
            return []
        enc = self._tok.encode(text, add_special_tokens=False)
        return [text[a:b].strip() or text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk]

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token is not None:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs) -> str:
        if not self.chat_template:
            raise KvstateError("this checkpoint has no chat template (tokenizer_config.json or chat_template.jinja)")
        return _render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)

    def message_ends(self, messages: list[dict[str, Any]], ids: list[int], *,
                     add_generation_prompt: bool = True, last: int | None = None) -> list[int]:
        """Token positions in `ids` (the rendered conversation, encoded without special tokens) where each
        message ends and any later request may branch: for every message but the first, the longest
        prefix shared with the same conversation whose message differs from its first character on
        (so it holds the previous message and the next one's header), and the end of the last message.
        Any template works: a rendering that shares less only yields a shorter (still valid) prefix.
        Each cut renders and encodes the whole conversation: `last` bounds them to the last `last`
        messages' ends (a server's choice: linear, not quadratic, in the number of messages)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        cuts = []
        first = 1 if last is None else max(1, len(messages) - last + 1)
        for k in range(first, len(messages)):
            other = [dict(m) for m in messages]
            other[k]["content"] = "\u2063" + str(other[k].get("content") or "")  # an invisible separator first
            try:
                other_text = self.apply_chat_template(other, add_generation_prompt=add_generation_prompt)
                cuts.append(common_prefix(text, other_text))
            except KvstateError:
                continue
        if add_generation_prompt:
            try:
                whole = self.apply_chat_template(messages, add_generation_prompt=False)
                if text.startswith(whole) and len(whole) < len(text):
                    cuts.append(len(whole))
            except KvstateError:
                pass
        ends = {common_prefix(self.encode(text[:c], add_special_tokens=False), ids) for c in cuts if c}
        return sorted(p for p in ends if 0 < p < len(ids))


def common_prefix(a, b) -> int:
    """Length of the common prefix of two sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _render(template: str, **context) -> str:
    import jinja2
    import jinja2.ext  # a submodule: `import jinja2` alone does not load it (transformers happened to)
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise KvstateError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**context)
    except jinja2.TemplateError as exc:
        raise KvstateError(f"chat template: {exc}") from None
