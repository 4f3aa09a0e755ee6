"""The shipped models' cards (README.md beside config.json) say what their tokenizer knows: the
counts and lists in the card are those of tokenizer.json, and the card ships as package data."""

import json
import re

import pytest

from kvstate.recall.chat_data import WORDS
from kvstate.recall.tasks import FIRST_NAMES, LAST_NAMES
from kvstate.shipped import SHIPPED, models_dir


@pytest.mark.parametrize("name", SHIPPED)
def test_card_matches_the_tokenizer(name):
    folder = models_dir() / name
    card = (folder / "README.md").read_text()
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    config = json.loads((folder / "config.json").read_text())
    assert len(vocab) == config["vocab_size"] == 1321 and "1,321 tokens" in card
    full_names = [t for t in vocab if re.fullmatch(r"[A-Z][a-z]+ [A-Z][a-z]+", t)]
    digits = [t for t in vocab if t.isdigit()]
    words = {t.strip() for t in vocab if re.fullmatch(r" ?[A-Za-z]+", t)}
    assert f"| full names | {len(full_names)} |" in card and len(full_names) == len(FIRST_NAMES) * len(LAST_NAMES)
    assert f"| digits | {len(digits)} |" in card and max(map(len, digits)) == 2
    assert f"| words | {2 * len(words)} |" in card and f"{len(words)} word forms" in card
    assert all(n in card for n in FIRST_NAMES + LAST_NAMES)
    listed = re.search(r"\*\*Words\*\* \(each also capitalised\): (.*?);", card, re.DOTALL).group(1).split()
    assert listed == list(WORDS) and {w.lower() for w in words} >= set(WORDS)
    assert f"--model {name}" in card


def test_cards_are_package_data():
    pyproject = (models_dir().parents[2] / "pyproject.toml").read_text()
    assert '"data/**/*"' in pyproject  # kvstate/data/models/<name>/README.md ships with the wheel
