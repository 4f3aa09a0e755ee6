"""Comma-separated number options (`--pairs 4,8,16`, `--lr 1e-3,3e-3`, `--beta 1,0.5`), parsed in
one place so every command words a bad value the same way, on one line."""

from __future__ import annotations

from kvstate.errors import KvstateError


def number_list(flag: str, text: str, kind=int, low: float | None = None, high: float | None = None) -> list:
    """"4,8,16" -> [4, 8, 16] (`kind` int or float); a KvstateError naming `flag` for a value that is
    not a number or lies outside [low, high] (either bound optional), or for an empty list."""
    try:
        values = [kind(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise KvstateError(f"{flag}: expected comma-separated {what}, got {text!r}") from None
    if not values:
        raise KvstateError(f"{flag}: at least one value, got {text!r}")
    if any((low is not None and v < low) or (high is not None and v > high) for v in values):
        bounds = (f"from {low:g} to {high:g}" if low is not None and high is not None
                  else f"at least {low:g}" if low is not None else f"at most {high:g}")
        raise KvstateError(f"{flag}: each {bounds}, got {text!r}")
    return values
