"""Incremental detokenization with stop strings (no torch): O(1) work per new token.

Decoding the whole output again after every token costs O(n) per token. As vLLM and TGI do, we
keep two offsets into the output ids: text is decoded only from `prefix_offset`, and the text of
`[prefix_offset, read_offset)` (already emitted) is cut from the front of the new decode; the
rest is the delta. A window whose text ends in U+FFFD is an incomplete multi-byte character (a
byte-level BPE splits characters across tokens): nothing is emitted until a later token
completes it. Decoding from a few tokens back (not from the new token alone) keeps what a
tokenizer does at word starts (SentencePiece's leading space) right.

Stop strings are searched only in the window the new text can complete (the last
len(stop) - 1 characters before it plus the new text). Text that could still become a stop
string (a suffix of the text that is a prefix of one) is held back and emitted only once it
cannot, so a streamed output never shows any part of the stop string; `finish()` releases what
is left when the request ends for another reason.
"""

from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for the bytes of an incomplete character


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self.decode = decode  # token ids -> text (skipping special tokens)
        self.stop = list(stop)
        self.ids: list[int] = []
        self.prefix_offset = 0  # first id of the decode window
        self.read_offset = 0  # ids before this are in `text`
        self.text = ""  # decoded so far (cut before the stop string once one is found)
        self.emitted = 0  # characters of `text` handed out by take()
        self.stop_reason: str | None = None

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string it completes, if any (then `text` ends before it)."""
        if self.stop_reason is not None:
            raise RuntimeError("token added after a stop string ended the output")
        self.ids.append(token_id)
        delta = self._decode_delta(final=False)
        if not delta:
            return None
        start = len(self.text)
        self.text += delta
        if self.stop:
            return self._find_stop(start)
        return None

    def finish(self) -> None:
        """The output ended (not by a stop string): flush an incomplete character as the full
        decode shows it, and stop holding back."""
        if self.stop_reason is None and self.read_offset < len(self.ids):
            self.text += self._decode_delta(final=True)
        self.stop = []

    def take(self) -> str:
        """The text not handed out yet that can no longer become part of a stop string."""
        end = len(self.text) - self._held_back()
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out

    def _decode_delta(self, *, final: bool) -> str:
        prefix = self.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith(REPLACEMENT) and not final):
            return ""  # an incomplete character (or nothing visible yet): wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix) :]

    def _find_stop(self, start: int) -> str | None:
        """Earliest stop string ending in the new text (text[start:]); cuts `text` before it."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, max(0, start - len(s) + 1))
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        self.stop_reason = best[1]
        self.stop = []
        return best[1]

    def _held_back(self) -> int:
        """Characters at the end of `text` that are the start of some stop string."""
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold
