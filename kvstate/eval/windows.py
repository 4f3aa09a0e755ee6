"""Sliding windows over a token stream (no torch).

A window of `context` tokens starts every `stride` tokens; each scores only the tokens no earlier
window scored, so every token after the first is scored once, with at least `context - stride`
tokens before it (all it has, in the first window; at least one, so with stride = context the
windows overlap by a token). The stride is Hugging Face's perplexity
guide's; llama-perplexity's chunks are the case stride = context / 2 scoring only the second half.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstate.errors import KvstateError


@dataclass(frozen=True)
class Window:
    begin: int  # first token fed
    end: int  # one past the last token fed
    first: int  # first token scored (by the logits of the token before it)


def sliding_windows(num_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """The windows over `num_tokens` tokens; stride defaults to context // 2."""
    stride = context // 2 if stride is None else stride
    if context < 2:
        raise KvstateError(f"--context must be at least 2 tokens, got {context}")
    if not 1 <= stride <= context:
        raise KvstateError(f"--stride must be in [1, context {context}], got {stride}")
    if num_tokens < 2:
        raise KvstateError(f"the text has {num_tokens} token(s): perplexity needs at least 2")
    out, scored = [], 1  # token 0 has nothing before it
    begin = 0
    while scored < num_tokens:
        end = min(begin + context, num_tokens)
        out.append(Window(begin, end, scored))
        scored = end
        begin = min(begin + stride, scored - 1)  # the next window holds the token before its first scored one
    return out
