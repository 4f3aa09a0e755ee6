"""--tp on generate: the same tokens as one process; what does not divide is one line, exit 2."""

import json
import subprocess
import sys

import pytest
import torch

from kvstate.cli import main
from tests.models.test_tokenizer import write_tokenizer
from tests.parallel.checkpoints import save_tiny


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "dense"
    save_tiny("dense", path, vocab=300)  # the tokenizer's 300 tokens
    write_tokenizer(path)
    return str(path)


def _tokens(checkpoint, tp, capsys):
    assert main(["generate", "--model", checkpoint, "the quick brown", "hybrid models", "--max-tokens", "6",
                 "--ignore-eos", "--json", "--cache-memory", "8MiB", "--tp", str(tp)]) == 0
    return [json.loads(line)["token_ids"] for line in capsys.readouterr().out.strip().splitlines()]


def test_generate_tp2_gives_the_same_tokens(checkpoint, capsys):
    torch.set_num_threads(1)
    assert _tokens(checkpoint, 2, capsys) == _tokens(checkpoint, 1, capsys)


def test_tp_that_does_not_divide_is_one_line(checkpoint):
    proc = subprocess.run([sys.executable, "-m", "kvstate", "generate", "--model", checkpoint, "hi", "--tp", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not divide by --tp 3" in lines[0] and "Traceback" not in proc.stderr
