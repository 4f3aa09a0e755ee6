"""Every whole-number option of every command refuses what it cannot mean (0 requests, -3 tokens,
a decode rate over 1 token, "x") on one line with exit 2, when the command line is parsed: before
a checkpoint loads or a benchmark starts, never as a traceback from inside the run."""

from __future__ import annotations

import argparse

import pytest

from kvstate.cli import build_parser, main

# options where 0 means something: top-k 0 = off, llama-prompt 0 = llama.cpp's decode only,
# copy-steps 0 = no copy warm-up, token id 0, seed 0
ZERO_ALLOWED = {"--top-k", "--llama-prompt", "--copy-steps", "--stop-token-id", "--seed"}


def _options(parser: argparse.ArgumentParser, path: tuple = ()):
    """(subcommand path, action) of every option in the command tree."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        elif action.option_strings:
            yield path, action


WHOLE = [(path, a) for path, a in _options(build_parser())
         if a.type is int or "whole number" in getattr(a.type, "__name__", "")]


def test_every_integer_option_is_checked_when_parsed():
    assert len(WHOLE) > 60  # the walk found the tree
    bare = [f"{' '.join(path)} {a.option_strings[-1]}" for path, a in WHOLE if a.type is int]
    assert bare == []  # a bare int takes -1 and 0, and the run fails later, or measures nonsense


@pytest.mark.parametrize("path,action", WHOLE, ids=[f"{' '.join(p)} {a.option_strings[-1]}" for p, a in WHOLE])
def test_a_whole_number_option_refuses_what_it_cannot_mean(path, action, capsys):
    flag = action.option_strings[-1]
    two = flag == "--new-tokens" or path == ("bench", "tp") and flag == "--tp"
    low = 0 if flag in ZERO_ALLOWED else 2 if two else 1
    assert action.type(str(low)) == low and action.type(str(low + 7)) == low + 7
    for bad in (str(low - 1), "-5", "x", "1.5"):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args([*path, flag, bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["--batches", "1,x"], "--batches: expected comma-separated whole numbers"),
    (["--batches", "0"], "--batches: each at least 1"),
    (["--profile", "8,-1"], "--profile: each at least 1"),
])
def test_bench_engine_batch_lists_are_checked_before_any_work(argv, message, capsys):
    assert main(["bench", "engine", "--quick", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
