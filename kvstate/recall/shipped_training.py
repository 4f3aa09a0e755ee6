"""Training the shipped phonebook models with kvstate's own decoder (autograd through its packed forward).

A step packs a batch of chats of different lengths into one varlen forward (no padding), with
every sequence owning one contiguous KV block and one state slot (`contiguous_caches`), and
takes the cross-entropy only at the assistant's reply tokens. The recipe is the one measured for
tiny recall models: AdamW (weight decay 0.1 on matrices), gradient clipping at 1; a copy stage
first at a constant lr of 5e-3 (`Curriculum`: short passages until the model repeats them, after a
plateau whose length varies from run to run, then long ones), then a fixed number of steps of phone books that
grow as the model answers, beside a quarter of copy chats, with the lr on a cosine from 3e-3. So
the costly steps (long books) are a fixed number whatever the plateau, and so is the time they
take. Everything is seeded, so a run is repeatable.

    model, plan = load_model(write_initial_checkpoint(cfg, tmp, seed=0))
    state = Trainer(model, TrainSettings(steps=400), tokenizer, seed=0)
    while not state.finished: loss, acc = state.step()
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvstate.models.batch import Batch
from kvstate.models.generate import contiguous_caches
from kvstate.recall.chat_data import Chat, copy_chat, encode_chat, phonebook_chat


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2700  # steps after the copy stage: books and copy chats, lr on a cosine from `lr`
    batch: int = 16
    lr: float = 3e-3
    copy_lr: float = 5e-3  # the copy stage's lr (constant after the warm-up)
    weight_decay: float = 0.1
    warmup: int = 30
    min_entries: int = 1
    max_entries: int = 64
    turns: int = 10  # questions per phone book
    copy_share: float = 0.25  # share of copy chats (after the copy stage)
    copy_words: tuple[int, int] = (2, 64)
    copy_first: int = 3000  # at most this many steps of copy chats only at the start (first_copy_words words),
    copy_until: float = 0.5  # ending sooner once the running exact repeat rate passes this
    copy_long: int = 600  # then this many steps of copy chats of copy_words words only (cheap: no books)
    first_copy_words: tuple[int, int] = (2, 10)
    start_entries: int = 2  # the largest book at the start
    grow_at: float = 0.5  # the largest book grows 1.5x each time the running exact accuracy passes this


def sample_chats(rng: np.random.Generator, s: TrainSettings, n: int, top: int, *, copy_stage: bool = False,
                 long_copies: bool = False) -> list[Chat]:
    """`n` chats: in the copy stage only copy chats, of `first_copy_words` words (`long_copies`: of
    `copy_words`); otherwise a `copy_share` of copy chats of `copy_words` and the rest phone books
    of min_entries to `top` entries."""
    if copy_stage:
        share, (lo, hi) = 1.0, s.copy_words if long_copies else s.first_copy_words
    else:
        share, (lo, hi) = s.copy_share, s.copy_words
    chats = []
    for _ in range(n):
        if rng.random() < share:
            chats.append(copy_chat(rng, int(rng.integers(lo, hi + 1))))
        else:
            chats.append(phonebook_chat(rng, int(rng.integers(s.min_entries, top + 1)), turns=s.turns))
    return chats


class Curriculum:
    """The largest book of the batches: small until the lookup is found, then growing.

    A tiny model finds the lookup on books of one or two entries, where the answer's line is
    easy to find; on larger books it stays on the plateau of answering the name right and the
    digits at chance (measured: with books growing on a fixed schedule to 24 entries over the
    first 320 steps, no exact answer after 600 steps). So the book grows when the model answers:
    by 1.5x (at least one entry) each time the running exact accuracy (an average over about the
    last 20 steps) passes `grow_at`, up to max_entries.

    Before the books, an optional copy stage: copy chats only, of a few words, until the running
    exact repeat rate passes `copy_until` (`copy_first` steps at most), then `copy_long` steps of
    passages of `copy_words` words. Both skills rest on the same induction head (find where the
    text just written occurred and continue it); a tiny `GAGA` forms it on short passages alone
    after a plateau of 500-2,500 steps, and on the mix of books and long passages not in the same
    budget."""

    def __init__(self, s: TrainSettings):
        self.s, self.top, self.running = s, max(s.min_entries, min(s.start_entries, s.max_entries)), 0.0
        self.copy_running, self.copied = 0.0, s.copy_first == 0
        self.short_end: int | None = None  # the step the short passages ended at
        self.copy_end: int | None = None  # the step the copy stage ended at

    def copy_stage(self, step: int) -> bool:
        """Short copy chats only: the first `copy_first` steps, or fewer once the model repeats passages."""
        return not self.copied and step < self.s.copy_first

    def stage(self, step: int) -> str:
        """"copy" (short passages), "copy-long" or "books" at `step` (asked in order: the ends of the
        copy stage's two parts are recorded when first seen)."""
        if self.copy_end is None:
            if self.short_end is None and not self.copy_stage(step):
                self.short_end = step
            if self.short_end is not None and step >= self.short_end + self.s.copy_long:
                self.copy_end = step
        return "books" if self.copy_end is not None else "copy" if self.short_end is None else "copy-long"

    def update(self, acc: float, copy_acc: float = float("nan")) -> None:
        if copy_acc == copy_acc:
            self.copy_running = 0.95 * self.copy_running + 0.05 * copy_acc
            self.copied = self.copied or self.copy_running > self.s.copy_until
        if acc != acc:  # no phone book in the batch
            return
        self.running = 0.95 * self.running + 0.05 * acc
        if self.running > self.s.grow_at and self.top < self.s.max_entries:
            self.top = min(self.s.max_entries, max(self.top + 1, round(self.top * 1.5)))
            self.running = 0.0


def packed_forward(model, sequences: list[list[int]], rows: torch.Tensor) -> torch.Tensor:
    """Logits [len(rows), vocab] at the packed positions `rows` (only those reach the LM head), the
    sequences packed into one batch (autograd-ready)."""
    n, max_len = len(sequences), max(len(s) for s in sequences)
    batch = Batch.build([len(s) for s in sequences], [0] * n, list(range(n)), [[i] for i in range(n)], max_len,
                        logits="all", device=model.device)
    batch.logits_indices = rows.to(model.device)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=model.device)
    return model(ids, batch, contiguous_caches(model, n, max_len))


def targets_of(encoded: list[tuple[list[int], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed next-token targets (-100 where untrained) [sum(T_i)] and the sequence of each position."""
    targets, owner = [], []
    for i, (ids, trained) in enumerate(encoded):
        targets += [ids[j + 1] if trained[j + 1] else -100 for j in range(len(ids) - 1)] + [-100]
        owner += [i] * len(ids)
    return torch.tensor(targets), torch.tensor(owner)


def first_answer_exact(logits: torch.Tensor, targets: torch.Tensor, owner: torch.Tensor, n: int) -> torch.Tensor:
    """[n] bool: every token of each sequence's first reply (and its end marker) is the argmax, i.e.
    greedy decoding would reproduce that reply exactly. `logits` [M, vocab] are those of the
    scored positions (targets != -100), in order."""
    ok = torch.ones(n, dtype=torch.bool)
    scored = (targets != -100).nonzero().flatten()
    right = logits.argmax(-1) == targets[scored]
    seen_gap = torch.zeros(n, dtype=torch.bool)
    last = torch.full((n,), -2)
    for pos, good in zip(scored.tolist(), right.tolist()):
        i = int(owner[pos])
        if last[i] >= 0 and pos != last[i] + 1:
            seen_gap[i] = True  # a later reply begins: only the first one counts
        last[i] = pos
        if not seen_gap[i] and not good:
            ok[i] = False
    return ok


class Trainer:
    def __init__(self, model, settings: TrainSettings, tokenizer, *, seed: int):
        self.model, self.s, self.tok = model, settings, tokenizer
        self.rng = np.random.default_rng(seed)
        torch.manual_seed(seed)
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
        rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))
        self.done = 0
        self.curriculum = Curriculum(settings)
        model.train()

    @property
    def short_end(self) -> int | None:
        return self.curriculum.short_end

    @property
    def copy_end(self) -> int | None:
        return self.curriculum.copy_end

    def in_copy_stage(self) -> bool:
        """Whether the next step is a copy-stage step (`Curriculum.stage`)."""
        return self.curriculum.stage(self.done) != "books"

    @property
    def total_steps(self) -> int:
        """All the run's steps: the copy stage's (at most copy_first + copy_long while it lasts) and
        `steps` after it."""
        if not self.in_copy_stage():
            return self.copy_end + self.s.steps
        return (self.s.copy_first if self.short_end is None else self.short_end) + self.s.copy_long + self.s.steps

    @property
    def finished(self) -> bool:
        return not self.in_copy_stage() and self.done - self.copy_end >= self.s.steps

    def lr(self) -> float:
        """The next step's lr: `copy_lr` in the copy stage; after it, a cosine over `steps` from `lr`
        down to lr / 10; a linear warm-up over the run's first `warmup` steps."""
        s = self.s
        warm = min(1.0, (self.done + 1) / s.warmup)
        if self.in_copy_stage():
            return s.copy_lr * warm
        frac = (self.done - self.copy_end) / max(1, s.steps)
        return s.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def step(self) -> tuple[float, float]:
        """One optimiser step on a fresh batch -> (loss, share of phonebook first answers exactly right)."""
        stage = self.curriculum.stage(self.done)
        chats = sample_chats(self.rng, self.s, self.s.batch, self.curriculum.top, copy_stage=stage != "books",
                             long_copies=stage == "copy-long")
        encoded = [encode_chat(self.tok, c) for c in chats]
        targets, owner = targets_of(encoded)
        rows = (targets != -100).nonzero().flatten()
        logits = packed_forward(self.model, [ids for ids, _ in encoded], rows)
        loss = F.cross_entropy(logits, targets[rows])
        for group in self.opt.param_groups:
            group["lr"] = self.lr()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.done += 1
        with torch.no_grad():
            exact = first_answer_exact(logits.detach(), targets, owner, len(chats))
            book = torch.tensor([c.kind == "phonebook" for c in chats])
            acc = float(exact[book].float().mean()) if book.any() else float("nan")
            copy_acc = float(exact[~book].float().mean()) if not book.all() else float("nan")
        self.curriculum.update(acc, copy_acc)
        return float(loss.detach()), acc


@torch.no_grad()
def reply_accuracy(model, tokenizer, chats: list[Chat]) -> float:
    """Share of the chats whose first reply is exactly right (teacher-forced argmax, equal to greedy)."""
    encoded = [encode_chat(tokenizer, c) for c in chats]
    targets, owner = targets_of(encoded)
    was = model.training
    model.eval()
    logits = packed_forward(model, [ids for ids, _ in encoded], (targets != -100).nonzero().flatten())
    model.train(was)
    return float(first_answer_exact(logits, targets, owner, len(chats)).float().mean())


def phonebook_accuracy(model, tokenizer, entries: int, *, n: int = 32, seed: int = 1234) -> float:
    """Exact first-answer accuracy on `n` fresh books of `entries` entries."""
    rng = np.random.default_rng(seed)
    return reply_accuracy(model, tokenizer, [phonebook_chat(rng, entries, turns=1) for _ in range(n)])


def copy_accuracy(model, tokenizer, words: int, *, n: int = 32, seed: int = 4321) -> float:
    """Share of `n` fresh passages of `words` random words repeated exactly ("Repeat this:")."""
    rng = np.random.default_rng(seed)
    return reply_accuracy(model, tokenizer, [copy_chat(rng, words) for _ in range(n)])
