"""argparse types for whole-number options, so a count that cannot be (0 requests, -3 tokens, a
decode measured over 1 token) is refused on one line before any work starts, by every command alike."""

from __future__ import annotations

import argparse


def whole_number(low: int = 1, why: str = ""):
    """An argparse `type`: a whole number >= `low`; `why` says, in the error, what the bound is for."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}{f' ({why})' if why else ''}, got {value}")
        return value

    parse.__name__ = f"whole number >= {low}"  # what argparse calls the type in its own messages
    return parse


count_arg = whole_number(1)  # requests, tokens, repeats, threads, ...
seed_arg = whole_number(0, "a seed")
decode_tokens_arg = whole_number(2, "a decode rate is measured between the first token and the last")
