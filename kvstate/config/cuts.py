"""Tensor-parallel cuts (no torch): which slice of a full parameter one rank holds, and what divides.

A mixer kind says how it shards (`kvstate.config.mixers`: `tp_problems`, `tp_local`, `tp_cuts`)
in these terms; `kvstate.parallel` applies them to plans, checkpoints and modules without knowing
the kinds.

A `Cut` says: along dimension `dim` the rank's parameter is these ranges of the full one, in
order. Column-parallel projections are cut along dim 0, segment by segment where one matrix holds
several ([q|k|v], [z|x|B|C|dt], ...); row-parallel ones along dim 1.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    dim: int
    full: int  # the full parameter's size along dim
    ranges: tuple[tuple[int, int], ...]  # [start, stop) of the full parameter, in the rank's order

    def owned(self) -> list[int]:
        return [i for a, b in self.ranges for i in range(a, b)]


def rows(full: int, *ranges: tuple[int, int]) -> Cut:
    """A column-parallel cut: these rows of a [full, ...] parameter."""
    return Cut(0, full, ranges)


def cols(full: int, *ranges: tuple[int, int]) -> Cut:
    """A row-parallel cut: these columns of a [..., full] parameter."""
    return Cut(1, full, ranges)


def part(n: int, tp: int, rank: int, base: int = 0, unit: int = 1) -> tuple[int, int]:
    """Rank's share of n units of `unit` rows starting at `base`."""
    per = n // tp
    return base + rank * per * unit, base + (rank + 1) * per * unit


def spread_range(n: int, tp: int, rank: int) -> tuple[int, int]:
    """The units (KV heads, B/C groups) a rank holds: n / tp of them, or the one its heads use when n < tp."""
    if n % tp == 0:
        return rank * (n // tp), (rank + 1) * (n // tp)
    first = rank // (tp // n)
    return first, first + 1


def divides(what: str, n: int, tp: int) -> str | None:
    return None if n % tp == 0 else f"{what} = {n} does not divide by --tp {tp}"


def spreads(what: str, n: int, tp: int) -> str | None:
    """n % tp == 0 (split) or tp % n == 0 (replicated, one per rank) is fine."""
    return None if n % tp == 0 or tp % n == 0 else f"{what} = {n}: neither divides by nor divides --tp {tp}"
