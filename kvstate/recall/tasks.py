"""Recall tasks with seedable generators and exact scoring (numpy only, no torch).

Three tasks, from the first spec document's caveat that a fixed-size state cannot hold every
detail of a long context:

- **MQAR** (multi-query associative recall, Zoology): key-value pairs, then queries of earlier
  keys placed at gaps drawn from a power law (short gaps likely, as repeated bigrams in text);
  the target at a query position is the value bound to that key.
- **Phonebook**: "Name: number" lines, then questions "What is Name's number?"; the answer is the
  number, digit for digit.
- **Needle**: one fact ("The magic number is 4817.") hidden at some depth in filler text, then the
  question; the answer is the number.

Token tasks return `TokenTask` (inputs and targets, -100 where nothing is scored, as a
cross-entropy loss ignores); text tasks return `TextExample`s (prompt, expected answers), which a
tokenizer turns into tokens for training or the engine answers for evaluation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

IGNORE = -100  # target of positions that are not scored


@dataclass(frozen=True)
class TokenTask:
    inputs: np.ndarray  # [B, T] int64 token ids
    targets: np.ndarray  # [B, T] int64: the token expected at the next position, IGNORE where unscored

    @property
    def num_scored(self) -> int:
        return int((self.targets != IGNORE).sum())


def mqar(num_examples: int, seq_len: int, num_pairs: int, *, vocab_size: int = 8192, power_a: float = 0.01,
         seed: int = 0, random_fill: bool = True) -> TokenTask:
    """Zoology's multi-query associative recall.

    Layout of one example: `k1 v1 k2 v2 ... kP vP` (keys from the lower half of the vocabulary,
    values from the upper half, all distinct within an example), then the query region where key
    k_i is placed at position 2 * gap_i, gaps drawn without replacement from p(g) ~ g^(power_a - 1);
    the target after each query key is its value. Other positions hold random tokens
    (`random_fill`) or 0. Token 0 is never a key or a value.
    """
    context = 2 * num_pairs
    if seq_len % 2 or seq_len < 2 * context:
        raise ValueError(f"mqar: seq_len must be even and >= 4 * num_pairs, got {seq_len} for {num_pairs} pairs")
    half = vocab_size // 2
    if num_pairs >= half or vocab_size <= seq_len:
        raise ValueError(f"mqar: vocab_size {vocab_size} too small for {num_pairs} pairs at length {seq_len}")
    rng = np.random.default_rng(seed)
    space = (seq_len - context) // 2  # query slots: even offsets of the query region
    p = np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    p /= p.sum()

    inputs = np.zeros((num_examples, seq_len), dtype=np.int64)
    targets = np.full((num_examples, seq_len), IGNORE, dtype=np.int64)
    if random_fill:
        inputs[:] = rng.integers(0, vocab_size, size=inputs.shape)
    for b in range(num_examples):
        keys = rng.choice(np.arange(1, half), size=num_pairs, replace=False)
        values = rng.choice(np.arange(half, vocab_size), size=num_pairs, replace=False)
        inputs[b, 0:context:2], inputs[b, 1:context:2] = keys, values
        gaps = rng.choice(space, size=num_pairs, replace=False, p=p)
        where = context + 2 * gaps  # query key positions
        inputs[b, where] = keys
        targets[b, where] = values  # predicted from the query key's position
    return TokenTask(inputs, targets)


def mqar_write_ranks(task: TokenTask, num_pairs: int) -> np.ndarray:
    """For each scored position (row-major order, as `targets != IGNORE` lists them) the write order
    of the pair it asks for: 0 for the first pair of its example, num_pairs - 1 for the last."""
    b, t = np.nonzero(task.targets != IGNORE)
    keys = task.inputs[:, 0 : 2 * num_pairs : 2]  # [B, P]
    return (keys[b] == task.inputs[b, t][:, None]).argmax(1)


def accuracy_by_rank(hits: np.ndarray, ranks: np.ndarray, num_pairs: int) -> list[float]:
    """Mean of `hits` [R] per write rank 0 .. num_pairs - 1 (oldest first); None where nothing asked it."""
    right = np.bincount(ranks, weights=hits.astype(np.float64), minlength=num_pairs)
    asked = np.bincount(ranks, minlength=num_pairs)
    return [round(float(r / a), 4) if a else None for r, a in zip(right, asked)]


# ---- text tasks ------------------------------------------------------------------------------

FIRST_NAMES = ("Alice", "Bruno", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas",
               "Kofi", "Lena", "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara",
               "Umar", "Vera", "Wen", "Ximena", "Yusuf", "Zoe")
LAST_NAMES = ("Smith", "Okafor", "Novak", "Tanaka", "Silva", "Khan", "Moreau", "Berg", "Costa", "Ivanova",
              "Mensah", "Laine", "Rossi", "Haddad", "Kim", "Patel", "Quist", "Ruiz", "Sato", "Weber")


@dataclass(frozen=True)
class TextExample:
    prompt: str  # the context and the question, ending where the answer starts
    answer: str  # the exact expected continuation (digits)
    entries: int  # phonebook entries or filler sentences in the context


def _number(rng: np.random.Generator, digits: int) -> str:
    return "".join(str(d) for d in rng.integers(0, 10, size=digits))


def phonebook_entries(num_entries: int, rng: np.random.Generator, *, digits: int = 4) -> list[tuple[str, str]]:
    """`num_entries` distinct (name, number) pairs; at most len(FIRST_NAMES) * len(LAST_NAMES)."""
    total = len(FIRST_NAMES) * len(LAST_NAMES)
    if not 1 <= num_entries <= total:
        raise ValueError(f"phonebook: 1 to {total} entries, got {num_entries}")
    picks = rng.choice(total, size=num_entries, replace=False)
    names = [f"{FIRST_NAMES[i // len(LAST_NAMES)]} {LAST_NAMES[i % len(LAST_NAMES)]}" for i in picks]
    return [(name, _number(rng, digits)) for name in names]


def phonebook_prompt(book: list[tuple[str, str]], name: str) -> str:
    """The phone book, one `Name: number` line each, then the question; the answer follows the prompt."""
    lines = "".join(f"{n}: {num}\n" for n, num in book)
    return f"{lines}What is {name}'s number? "


def phonebook(num_entries: int, *, num_queries: int = 1, digits: int = 4, seed: int = 0) -> list[TextExample]:
    """`num_queries` questions about one book of `num_entries` entries (names asked drawn without
    replacement where the book is large enough)."""
    rng = np.random.default_rng(seed)
    book = phonebook_entries(num_entries, rng, digits=digits)
    asked = rng.choice(num_entries, size=num_queries, replace=num_queries > num_entries)
    return [TextExample(phonebook_prompt(book, book[i][0]), book[i][1], num_entries) for i in asked]


FILLER = ("The grass is green.", "The sky is blue.", "The sun is warm.", "Rivers run to the sea.",
          "Birds sing in the morning.", "Bread is baked in an oven.", "Snow falls in winter.")


def needle(num_sentences: int, *, depth: float | None = None, digits: int = 4, seed: int = 0) -> TextExample:
    """One fact hidden among `num_sentences` filler sentences at relative `depth` in [0, 1]
    (random if None), then the question."""
    if num_sentences < 1:
        raise ValueError(f"needle: at least one filler sentence, got {num_sentences}")
    rng = np.random.default_rng(seed)
    number = _number(rng, digits)
    where = int(rng.integers(0, num_sentences + 1)) if depth is None else round(depth * num_sentences)
    if not 0 <= where <= num_sentences:
        raise ValueError(f"needle: depth must be in [0, 1], got {depth}")
    sentences = [FILLER[i] for i in rng.integers(0, len(FILLER), size=num_sentences)]
    sentences.insert(where, f"The magic number is {number}.")
    return TextExample(" ".join(sentences) + "\nWhat is the magic number? ", number, num_sentences)


def first_number(text: str) -> str | None:
    """The first maximal run of digits in `text` (None when it has none)."""
    m = re.search(r"[0-9]+", text)
    return m.group() if m else None
