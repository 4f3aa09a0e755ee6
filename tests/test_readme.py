"""README.md's commands work on a fresh clone: every fenced block marked `<!-- runnable -->` (or
`<!-- runnable expect="text" -->`) runs here, with this tree's `kvstate` on PATH, in a temporary
directory, and must exit 0 (printing `expect` when given, and no unknown-word warning). A shell
block left unmarked must say why it cannot run here: a downloaded checkpoint (`path/to/...`),
`make`, a server that does not return, or a benchmark too long for the test suite."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200
# an unmarked shell block must contain one of these
CANNOT_RUN_HERE = ("path/to/", "make ", "kvstate serve", "kvstate bench")
BLOCK = re.compile(r"(?:<!-- runnable(?: expect=\"(?P<expect>[^\"]*)\")? -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```",
                   re.DOTALL)


def _blocks(text: str):
    """(language, body, runnable, expect) of every fenced block, in order."""
    for m in BLOCK.finditer(text):
        runnable = m.group(0).startswith("<!-- runnable")
        yield m.group("lang"), m.group("body"), runnable, m.group("expect")


def _runnable():
    return [(lang, body, expect) for lang, body, runnable, expect in _blocks(README.read_text()) if runnable]


def test_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    quick = text.split("## Quick start", 1)[1]
    _, body, _, _ = next(_blocks(quick))
    assert [line.split("#")[0].strip() for line in body.strip().splitlines()] == ["make run", "make test"]


def test_unmarked_shell_blocks_say_why_they_cannot_run_here():
    blocks = list(_blocks(README.read_text()))
    assert sum(runnable for *_, runnable, _ in blocks) >= 4
    for lang, body, runnable, _ in blocks:
        if lang in ("sh", "bash") and not runnable:
            lines = [line for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            for line in lines:
                assert any(reason in line for reason in CANNOT_RUN_HERE), f"mark it runnable or say why: {line}"
        if runnable:  # what runs (comments aside) needs nothing a fresh clone lacks
            code = "\n".join(line.split("#")[0] for line in body.splitlines())
            assert lang in ("bash", "python") and "path/to/" not in code and "make " not in code


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory):
    """PATH with `kvstate` and `python` of this interpreter and this tree, as `make install` gives."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, args in (("kvstate", "-m kvstate"), ("python", "")):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        shim.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT),
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", COLUMNS="160")


@pytest.mark.parametrize("lang, body, expect", _runnable(), ids=lambda v: v.strip().splitlines()[0][:40]
                         if isinstance(v, str) and "\n" in v else None)
def test_runnable_block(lang, body, expect, shell_env, tmp_path):
    argv = ["bash", "-euo", "pipefail", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
    proc = subprocess.run(argv, check=False, cwd=tmp_path, env=shell_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()
    assert "UnknownTokenWarning" not in proc.stderr and "warning:" not in proc.stderr, proc.stderr
    if expect:
        assert expect in proc.stdout, proc.stdout[-2000:]
