"""A prompt the checkpoint's tokenizer cannot read warns once (count and first unknown word), from
`LLM` and from `kvstate generate`; a prompt it can read never does."""

import warnings

import pytest

from kvstate import LLM, UnknownTokenWarning, model_path
from kvstate.cli import main
from kvstate.models.tokenizer import Tokenizer

HYBRID = model_path("kvstate-phonebook-hybrid")
ONE_TOKEN = {"max_tokens": 1, "temperature": 0}


@pytest.fixture(scope="module")
def llm():
    return LLM(HYBRID, cache_memory="8MiB")


def _unknown_warnings(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, UnknownTokenWarning)]


def test_the_shipped_tokenizer_names_its_unknown_words():
    tok = Tokenizer(HYBRID)
    assert tok.unk_id == 3 and tok.vocab_size == 1321
    assert tok.unknown_words("Once upon a time, the quick brown fox") == ["Once", "upon", "quick", "brown", "fox"]
    assert tok.unknown_words("Alice Smith: 1234\nWhat is Alice Smith's number?") == []


def test_llm_warns_once_per_prompt_with_count_and_first_word(llm):
    first = _unknown_warnings(lambda: llm.generate("Once upon a time", ONE_TOKEN))
    assert len(first) == 1 and "2 words" in first[0] and "'Once'" in first[0]
    assert _unknown_warnings(lambda: llm.generate("Once upon a time", ONE_TOKEN)) == []  # the same prompt: once
    other = _unknown_warnings(lambda: list(llm.stream(["the quick dog", "the quick dog"], ONE_TOKEN)))
    assert len(other) == 1 and "1 word " in other[0] and "'quick'" in other[0]


def test_chat_warns_about_the_users_words(llm):
    found = _unknown_warnings(lambda: llm.chat([{"role": "user", "content": "Repeat this: zebra dog"}], ONE_TOKEN))
    assert len(found) == 1 and "'zebra'" in found[0]


def test_in_vocabulary_prompts_and_token_ids_never_warn(llm):
    book = "Alice Smith: 1234\nBruno Novak: 5678\nWhat is Alice Smith's number?"
    assert _unknown_warnings(lambda: llm.generate(book, ONE_TOKEN)) == []
    assert _unknown_warnings(lambda: llm.chat([{"role": "user", "content": book}], ONE_TOKEN)) == []
    unk = llm.tokenizer.unk_id
    assert _unknown_warnings(lambda: llm.generate([[5, unk, 6]], ONE_TOKEN)) == []  # ids: the caller's choice


def test_generate_cli_prints_one_warning_line(capsys):
    assert main(["generate", "Once upon a time", "--max-tokens", "1"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "warning:" in line]
    assert len(lines) == 1 and "2 words" in lines[0] and "'Once'" in lines[0] and "README.md" in lines[0]
    assert main(["generate", "--chat", "Alice Smith: 1234\nWhat is Alice Smith's number?", "--max-tokens", "1"]) == 0
    assert "warning" not in capsys.readouterr().err
