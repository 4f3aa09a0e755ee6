"""The recall tasks: structure of the examples, seeding, and exact scoring."""

import re

import numpy as np
import pytest

from kvstate.recall.tasks import IGNORE, TokenTask, first_number, mqar, needle, phonebook


def mqar_accuracy(task: TokenTask, predictions: np.ndarray) -> float:
    """Fraction of scored positions whose predicted token ([B, T], argmax of the logits) is the target."""
    mask = task.targets != IGNORE
    if not mask.any():
        raise ValueError("no scored positions")
    return float((predictions[mask] == task.targets[mask]).mean())


def test_mqar_queries_ask_earlier_keys_and_targets_are_their_values():
    task = mqar(50, 64, 8, vocab_size=512, seed=3)
    assert task.inputs.shape == task.targets.shape == (50, 64)
    assert task.num_scored == 50 * 8
    for x, y in zip(task.inputs, task.targets):
        keys, values = x[0:16:2], x[1:16:2]
        assert len(set(keys)) == 8 and len(set(values)) == 8
        assert (keys >= 1).all() and (keys < 256).all() and (values >= 256).all()
        bound = dict(zip(keys.tolist(), values.tolist()))
        scored = np.flatnonzero(y != IGNORE)
        assert (scored >= 16).all() and ((scored - 16) % 2 == 0).all()
        assert sorted(x[scored].tolist()) == sorted(keys.tolist())  # each key asked once
        assert all(bound[int(x[i])] == int(y[i]) for i in scored)


def test_mqar_is_seeded_and_power_law_favours_short_gaps():
    a, b, c = mqar(20, 128, 4, seed=1), mqar(20, 128, 4, seed=1), mqar(20, 128, 4, seed=2)
    assert np.array_equal(a.inputs, b.inputs) and np.array_equal(a.targets, b.targets)
    assert not np.array_equal(a.inputs, c.inputs)
    task = mqar(400, 256, 4, seed=0)
    gaps = (np.flatnonzero(task.targets.reshape(-1) != IGNORE) % 256 - 8) // 2
    assert np.mean(gaps < 30) > 0.5  # 124 query slots: uniform would put ~24% below 30


def test_mqar_accuracy_counts_only_scored_positions():
    task = mqar(4, 32, 2, vocab_size=128, seed=0)
    perfect = np.where(task.targets != IGNORE, task.targets, 0)
    assert mqar_accuracy(task, perfect) == 1.0
    half = perfect.copy()
    rows, cols = np.nonzero(task.targets != IGNORE)
    half[rows[::2], cols[::2]] += 1
    assert mqar_accuracy(task, half) == 0.5


def test_mqar_rejects_impossible_settings():
    with pytest.raises(ValueError, match="seq_len"):
        mqar(1, 30, 8)
    with pytest.raises(ValueError, match="vocab_size"):
        mqar(1, 64, 4, vocab_size=32)


def test_phonebook_asks_a_name_of_the_book_and_expects_its_number():
    examples = phonebook(12, num_queries=5, seed=7)
    assert len(examples) == 5 and len({e.prompt for e in examples}) == 5
    for e in examples:
        lines = e.prompt.split("\n")
        book = dict(line.split(": ") for line in lines[:-1])
        assert len(book) == 12 and e.entries == 12
        name = re.fullmatch(r"What is (.+)'s number\? ", lines[-1]).group(1)
        assert book[name] == e.answer and re.fullmatch(r"\d{4}", e.answer)
    assert phonebook(12, seed=7)[0] == phonebook(12, seed=7)[0]


def test_needle_hides_one_fact_at_the_given_depth():
    first, last = needle(10, depth=0.0, seed=1), needle(10, depth=1.0, seed=1)
    assert first.prompt.startswith(f"The magic number is {first.answer}.")
    assert last.prompt.split("\n")[0].endswith(f"The magic number is {last.answer}.")
    assert first.prompt.count("magic number is") == 1
    with pytest.raises(ValueError, match="depth"):
        needle(10, depth=1.5)


def test_first_number_reads_the_reply_digit_exact():
    assert first_number("0421\nWhat") == "0421"
    assert first_number("04210") != "0421" and first_number("0422") != "0421"
    assert first_number(" 0421") == "0421"  # a reply may start with a space or words before the number
    assert first_number("Nadia Khan: 0421<|im_end|>") == "0421"
    assert first_number("It is 0421.") == "0421" and first_number("0421") == "0421"
    assert first_number("04210") == "04210" != "0421" and first_number("042 1") == "042"
    assert first_number("no digits") is None
