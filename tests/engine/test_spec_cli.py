"""`kvstate generate` with speculative decoding flags: same tokens, a speculation line, one-line errors."""

import json

import pytest

from kvstate.cli import main
from tests.engine.test_generate_cli import _cli, _one_line_error, checkpoint  # noqa: F401 (fixture)

PROMPT = "the quick brown the quick brown the quick brown"


def _tokens(capsys, *flags):
    assert main(["generate", "--model", str(flags[0]), PROMPT, "--max-tokens", "8", "--ignore-eos", "--json",
                 *flags[1:]]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_speculation_flags_give_the_same_tokens(checkpoint, capsys):  # noqa: F811
    plain = _tokens(capsys, checkpoint)
    for flags in (["--speculative-ngram", "3"], ["--speculative-model", str(checkpoint), "--speculative-tokens", "2"],
                  ["--spec-model", str(checkpoint), "--spec-tokens", "2"],  # the old spellings, hidden aliases
                  ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}']):
        row = _tokens(capsys, checkpoint, *flags)
        assert row["token_ids"] == plain["token_ids"]
        assert row["metrics"]["num_draft_tokens"] > 0 or "--speculative-model" not in flags  # lookup may find nothing
    assert main(["generate", "--model", str(checkpoint), PROMPT, "--max-tokens", "6", "--ignore-eos",
                 "--speculative-model", str(checkpoint)]) == 0
    err = capsys.readouterr().err
    assert "speculation:" in err and "(100%)" in err  # the model drafting for itself


@pytest.mark.parametrize("flags, needle", [
    (["--speculative-config", "{nope"], "--speculative-config"),
    (["--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'], "method"),
    (["--speculative-ngram", "2", "--speculative-model", "x"], "one way"),
    (["--spec-mtp", "2", "--speculative-ngram", "2"], "one way"),
    (["--speculative-mtp", "1"], "method 'mtp' needs a checkpoint with multi-token-prediction weights"),
])
def test_bad_speculation_flags_are_one_line(checkpoint, flags, needle):  # noqa: F811
    _one_line_error(_cli("--model", str(checkpoint), "hi", *flags), needle)


def test_old_spellings_are_hidden_aliases():
    from kvstate.cli import build_parser

    parser = build_parser()
    for new, old in (("--speculative-ngram", "--spec-ngram"), ("--speculative-mtp", "--spec-mtp")):
        assert vars(parser.parse_args(["generate", "hi", new, "3"])) == \
            vars(parser.parse_args(["generate", "hi", old, "3"]))
    sub = parser._subparsers._group_actions[0].choices["serve"]
    assert "--speculative-ngram" in sub.format_help() and "--spec-ngram" not in sub.format_help()
    assert parser.parse_args(["bench", "spec", "--quick"])._bench_module == "kvstate.bench.speculative"
