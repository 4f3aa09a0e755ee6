"""The explorer's recall panel: how much probability the loaded model gives each candidate answer.

A needle or phonebook prompt comes from `kvstate.recall.tasks` (seeded), with the true answer and
look-alike candidates (one digit changed, as spec 002's X7-Q against X7-G; for the phonebook also
the numbers of other people in the same book). Every candidate is appended to the prompt and all
of them run as ONE packed forward (`forward_logits`); a candidate's log-probability is the sum of
its tokens' log-probs at the positions that predict them. Nothing is sampled, nothing is drawn
from constants: the bars are the model's own distribution over the candidates.
"""

from __future__ import annotations

import math

import numpy as np

from kvstate.errors import KvstateError
from kvstate.recall import tasks

TASKS = ("needle", "phonebook")
MAX_SIZE = {"needle": 2000, "phonebook": len(tasks.FIRST_NAMES) * len(tasks.LAST_NAMES)}


def _near_misses(answer: str, rng: np.random.Generator, count: int) -> list[str]:
    """`count` distinct numbers that differ from `answer` in exactly one digit."""
    out: list[str] = []
    while len(out) < count:
        pos, digit = int(rng.integers(len(answer))), str(int(rng.integers(10)))
        cand = answer[:pos] + digit + answer[pos + 1:]
        if cand != answer and cand not in out:
            out.append(cand)
    return out


def example(task: str, size: int, seed: int = 0, depth: float | None = None) -> tuple[str, str, list[str]]:
    """(prompt, answer, candidates with the answer first) for a needle among `size` filler
    sentences or a phonebook of `size` entries."""
    if task not in TASKS:
        raise KvstateError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if not 1 <= size <= MAX_SIZE[task]:
        raise KvstateError(f"{task}: size must be between 1 and {MAX_SIZE[task]}, got {size}")
    rng = np.random.default_rng(seed + 1)  # candidates apart from the task's own draws
    if task == "needle":
        if depth is not None and not 0 <= depth <= 1:
            raise KvstateError(f"depth must be between 0 and 1, got {depth}")
        ex = tasks.needle(size, depth=depth, seed=seed)
        return ex.prompt, ex.answer, [ex.answer, *_near_misses(ex.answer, rng, 4)]
    ex = tasks.phonebook(size, seed=seed)[0]
    book = tasks.phonebook_entries(size, np.random.default_rng(seed))  # the same book phonebook() drew
    others = list(dict.fromkeys(num for _, num in book if num != ex.answer))[:3]
    misses = _near_misses(ex.answer, rng, 5 - 1 - len(others))
    return ex.prompt, ex.answer, [ex.answer, *others, *misses]


def score(model, tokenizer, prompt: str, candidates: list[str], max_len: int) -> tuple[int, list[dict]]:
    """(prompt tokens, [{text, tokens, logprob, prob, share}]) from one packed forward."""
    return score_ids(model, tokenizer, tokenizer.encode(prompt), candidates, max_len)


def score_ids(model, tokenizer, prompt_ids: list[int], candidates: list[str], max_len: int) -> tuple[int, list[dict]]:
    """`score` of a prompt already in token ids (e.g. in a checkpoint's chat format)."""
    import torch

    from kvstate.models.generate import forward_logits

    cand_ids = [tokenizer.encode(c, add_special_tokens=False) for c in candidates]
    longest = len(prompt_ids) + max(len(c) for c in cand_ids)
    if longest > max_len:
        raise KvstateError(f"the prompt and an answer take {longest} tokens, more than the served model's "
                           f"max_model_len {max_len} (choose a smaller size)")
    logits = forward_logits(model, [prompt_ids + c for c in cand_ids])  # per candidate [T_i, vocab]
    p = len(prompt_ids)
    sums = []
    for c, lg in zip(cand_ids, logits):
        logp = torch.log_softmax(lg[p - 1 : p - 1 + len(c)].float(), dim=-1)  # rows that predict the candidate
        sums.append(float(logp[torch.arange(len(c)), torch.tensor(c)].sum()))
    top = max(sums)
    total = sum(math.exp(s - top) for s in sums)
    rows = [{"text": text, "tokens": len(c), "logprob": s, "prob": math.exp(s), "share": math.exp(s - top) / total}
            for text, c, s in zip(candidates, cand_ids, sums)]
    return p, rows
