"""The scheduler's waiting queue: round-robin over request groups, so one client cannot starve the others (no torch).

A server turns one HTTP request into one engine request per prompt and sample (a list of 1000
prompts with n = 16 is 16,000). Admitted first come first served, such a request would hold every
running slot until its last sequence started; a chat sent after it would wait behind all of them.
So each engine request names a `group` (the HTTP request it belongs to; None: its own group), and
admission takes the groups in turn: one sequence of the oldest group, then one of the next, and so
on, each group's own sequences in arrival order. A request that arrives later joins the end of the
ring, so it waits at most one admission per group ahead of it, not for their whole fan-out.
Requests without a group are their own groups: the order is then plain arrival order, as before.

Preempted sequences go back to the front (`appendleft`) and are admitted before any group.
The deque-like interface (`append`, `appendleft`, `popleft`, `remove`, `[0]`, iteration in admission
order, `len`) is what the scheduler used of its `collections.deque`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterator


class FairQueue:
    def __init__(self) -> None:
        self._front: deque = deque()  # preempted: first in line
        self._groups: OrderedDict[object, deque] = OrderedDict()  # group -> its waiting sequences; the ring
        self._len = 0

    @staticmethod
    def _key(seq) -> object:
        group = getattr(seq, "group", None)
        return ("own", id(seq)) if group is None else ("group", group)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, seq) -> None:
        """Queue a new sequence at the end of its group (a new group joins the end of the ring)."""
        key = self._key(seq)
        if key not in self._groups:
            self._groups[key] = deque()
        self._groups[key].append(seq)
        self._len += 1

    def appendleft(self, seq) -> None:
        """Put a preempted sequence first in line."""
        self._front.appendleft(seq)
        self._len += 1

    def __getitem__(self, index: int):
        if index != 0:  # the head is the scheduler's question; anything else walks the order
            return list(self)[index]
        if self._front:
            return self._front[0]
        if self._groups:
            return next(iter(self._groups.values()))[0]
        raise IndexError("the queue is empty")

    def popleft(self):
        """Take the head; its group (if it came from one) moves to the end of the ring."""
        if self._front:
            self._len -= 1
            return self._front.popleft()
        if not self._groups:
            raise IndexError("pop from an empty queue")
        key, seqs = next(iter(self._groups.items()))
        seq = seqs.popleft()
        if seqs:
            self._groups.move_to_end(key)
        else:
            del self._groups[key]
        self._len -= 1
        return seq

    def remove(self, seq) -> None:
        if seq in self._front:
            self._front.remove(seq)
        else:
            key = self._key(seq)
            seqs = self._groups.get(key)
            if seqs is None:
                raise ValueError("the sequence is not waiting")
            seqs.remove(seq)
            if not seqs:
                del self._groups[key]
        self._len -= 1

    def __iter__(self) -> Iterator:
        """Every waiting sequence in the order `popleft` would give them now."""
        yield from self._front
        rings = [list(q) for q in self._groups.values()]
        for i in range(max((len(r) for r in rings), default=0)):
            for r in rings:
                if i < len(r):
                    yield r[i]
