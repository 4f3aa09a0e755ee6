"""Output that is not a terminal: a closed pipe is not an error, and tables written to a file or a
pipe keep every name whole (rich would squeeze them into 80 columns and cut cells to `gat…`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvstate.cli import main
from kvstate.config import bundled_names

ROOT = Path(__file__).resolve().parents[1]
MANY = "1k,2k,4k,8k,16k,32k,64k,128k,256k,512k,1m"


@pytest.mark.parametrize("argv", [
    ["memory"], ["memory", "--json"], ["memory", "--layers", "--context", MANY], ["--help"], ["memory", "--help"],
])
def test_a_closed_pipe_is_not_an_error(argv):
    # The reader closes its end before kvstate writes anything (as `| head -1` does after the
    # first line): every write fails with EPIPE. Exit 0, nothing on stderr.
    proc = subprocess.Popen([sys.executable, "-m", "kvstate", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""


def test_memory_table_to_a_pipe_keeps_model_names_whole():
    proc = subprocess.run([sys.executable, "-m", "kvstate", "memory", "--context", MANY], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    names = [row.split("│")[1].strip() for row in rows if row.split("│")[1].strip()]
    assert names == bundled_names()  # the configs, then the shipped models
    assert "1M" in proc.stdout and "kv bfloat16, state float32" in proc.stdout


def test_bench_table_to_a_pipe_keeps_every_cell_whole(capsys):
    assert main(["bench", "ops", "--quick", "--only", "gated_delta_rule", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out
    assert "gated_delta_rule" in out and "chunk" in out and "recurrent" in out
