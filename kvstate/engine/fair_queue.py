"""The scheduler's waiting queue: round-robin over request groups, so one client cannot starve the others (no torch).

A server turns one HTTP request into one engine request per prompt and sample (a list of 1000
prompts with n = 16 is 16,000). Admitted first come first served, such a request would hold every
running slot until its last sequence started; a chat sent after it would wait behind all of them.
So each engine request names a `group` (the HTTP request it belongs to; None: its own group), and
admission takes the groups in turn: one sequence of the oldest group, then one of the next, and so
on, each group's own sequences in arrival order. A request that arrives later joins the end of the
ring, so it waits at most one admission per group ahead of it, not for their whole fan-out.
Requests without a group are their own groups: the order is then plain arrival order, as before.

A fair share on top of the turns: while other groups wait, a group already running at least its
share (`max_num_seqs` / the number of groups running or waiting) is passed over (`pick`), so one
request's many sequences fill only the slots no one else asks for; and when every slot is taken,
the scheduler preempts one sequence of the group furthest above its share for a group below it
(`fair_victim`). Both move a group only from above its share to at most it, so they cannot
ping-pong, and a preempted sequence is recomputed as any other, so outputs are unchanged.

Preempted sequences go back to the front (`appendleft`) and are admitted before any group below
its share. The deque-like interface (`append`, `appendleft`, `popleft`, `remove`, `[0]`, iteration in admission
order, `len`) is what the scheduler used of its `collections.deque`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from typing import Iterable, Iterator


def group_key(seq) -> object:
    """The group a sequence is admitted by: its request group, or itself when it has none."""
    group = getattr(seq, "group", None)
    return ("own", id(seq)) if group is None else ("group", group)


def fair_shares(running: Iterable, waiting: FairQueue, max_num_seqs: int) -> tuple[Counter, float]:
    """Running sequences per group, and the fair share: max_num_seqs over the groups running or waiting."""
    counts = Counter(group_key(s) for s in running)
    groups = set(counts) | waiting.group_keys()
    return counts, max_num_seqs / max(1, len(groups))


def fair_victim(running: list, counts: Counter, share: float, head) -> object | None:
    """The running sequence to preempt so that `head` (the waiting sequence `pick` chose) gets a slot:
    only when head's group is at least one below its share, from the group furthest above it (at least
    one above), the one with the fewest computed tokens (the cheapest to recompute; the newest on ties)."""
    if counts[group_key(head)] + 1 > share:
        return None
    over = max(counts, key=lambda k: counts[k], default=None)
    if over is None or counts[over] - 1 < share:
        return None
    cands = [s for s in running if group_key(s) == over]
    return min(reversed(cands), key=lambda s: s.num_computed_tokens)


class FairQueue:
    def __init__(self) -> None:
        self._front: deque = deque()  # preempted: first in line
        self._groups: OrderedDict[object, deque] = OrderedDict()  # group -> its waiting sequences; the ring
        self._len = 0

    _key = staticmethod(group_key)

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

    def group_keys(self) -> set:
        return {self._key(s) for s in self._front} | set(self._groups)

    def pick(self, counts: Counter, share: float):
        """The sequence to admit next: the first in line (preempted ones, then each group's head in
        ring order) whose group runs fewer than `share` sequences (`counts`); the head when none does."""
        for seq in self._front:
            if counts[self._key(seq)] < share:
                return seq
        for key, seqs in self._groups.items():
            if counts[key] < share:
                return seqs[0]
        return self[0]

    def popleft(self, seq=None):
        """Take the head, or `seq` (the head of the front or of its group, as `pick` gives); its group
        (if it came from one) moves to the end of the ring."""
        if seq is None or (self._front and seq is self._front[0]):
            if self._front:
                self._len -= 1
                return self._front.popleft()
        elif seq in self._front:
            self._front.remove(seq)
            self._len -= 1
            return seq
        if not self._groups:
            raise IndexError("pop from an empty queue")
        key = next(iter(self._groups)) if seq is None else self._key(seq)
        seqs = self._groups[key]
        if seq is not None and seqs[0] is not seq:
            raise ValueError("only the head of a group can be taken")
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
