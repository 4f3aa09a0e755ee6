"""Fixed train and held-out sets for the recall trainer, as token tasks ([B, T] ids and targets).

MQAR comes from `kvstate.recall.tasks.mqar` (held-out set from another seed). The phonebook is
text (`tasks.phonebook_prompt`) read as characters: token = byte value (vocabulary 128, 0 pads).
One example is a book of `entries` lines, then `queries` questions each followed by its answer
and a newline; the targets are the answer digits, predicted from the position before each digit.
"""

from __future__ import annotations

import numpy as np

from kvstate.errors import KvstateError
from kvstate.recall import tasks

CHAR_VOCAB = 128
EVAL_SEED_OFFSET = 1_000_003  # held-out sets are drawn from seeds no train set uses


def phonebook_task(num_examples: int, entries: int, *, queries: int = 4, digits: int = 4,
                   seed: int = 0) -> tasks.TokenTask:
    rng = np.random.default_rng(seed)
    rows, answer_at = [], []
    for _ in range(num_examples):
        book = tasks.phonebook_entries(entries, rng, digits=digits)
        text = "".join(f"{n}: {num}\n" for n, num in book)
        where = []
        for i in rng.choice(entries, size=queries, replace=queries > entries):
            text += f"What is {book[i][0]}'s number? "
            where.append(len(text))
            text += book[i][1] + "\n"
        rows.append(text)
        answer_at.append(where)
    t = max(len(r) for r in rows)
    inputs = np.zeros((num_examples, t), dtype=np.int64)
    targets = np.full((num_examples, t), tasks.IGNORE, dtype=np.int64)
    for b, (text, where) in enumerate(zip(rows, answer_at)):
        ids = np.frombuffer(text.encode("ascii"), dtype=np.uint8).astype(np.int64)
        inputs[b, : len(ids)] = ids
        for start in where:  # the digit at position start + j is predicted at start + j - 1
            targets[b, start - 1 : start - 1 + digits] = ids[start : start + digits]
    return tasks.TokenTask(inputs, targets)


def make_sets(cfg) -> tuple[tasks.TokenTask, tasks.TokenTask, int]:
    """(train, held-out, vocabulary size) for a `TrainConfig`."""
    try:
        if cfg.task == "mqar":
            make = lambda n, seed: tasks.mqar(n, cfg.seq_len, cfg.pairs, vocab_size=cfg.vocab, seed=seed,  # noqa: E731
                                                 random_fill=cfg.fill == "random")
            vocab = cfg.vocab
        elif cfg.task == "phonebook":
            make = lambda n, seed: phonebook_task(n, cfg.pairs, seed=seed)  # noqa: E731
            vocab = CHAR_VOCAB
        else:
            raise KvstateError(f"unknown task {cfg.task!r}: mqar or phonebook")
        return make(cfg.train_examples, cfg.seed), make(cfg.eval_examples, cfg.seed + EVAL_SEED_OFFSET), vocab
    except ValueError as exc:
        if isinstance(exc, KvstateError):
            raise
        raise KvstateError(str(exc)) from None
