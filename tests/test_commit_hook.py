""".githooks/commit-msg enforces the commit rule: a subject of at most 72 characters, a blank
line before the body; git's comment lines are ignored."""

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).resolve().parents[1] / ".githooks" / "commit-msg"


def _hook(tmp_path, message: str) -> subprocess.CompletedProcess:
    path = tmp_path / "COMMIT_EDITMSG"
    path.write_text(message)
    return subprocess.run(["sh", str(HOOK), str(path)], check=False, capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "LC_ALL": "C"})


@pytest.mark.parametrize("message", [
    "engine: keep the verified state\n\nWhy, what was measured, in the body.\n",
    "x" * 72 + "\n",
    "# Please enter the commit message\n\nok subject\n",
    "é" * 72 + "\n",  # characters, not bytes
])
def test_accepts(tmp_path, message):
    assert _hook(tmp_path, message).returncode == 0


def test_refuses_a_long_subject(tmp_path):
    proc = _hook(tmp_path, "x" * 73 + "\n\nbody\n")
    assert proc.returncode == 1 and "73 characters" in proc.stderr


def test_refuses_a_body_without_a_blank_line(tmp_path):
    proc = _hook(tmp_path, "subject\nbody right away\n")
    assert proc.returncode == 1 and "blank line" in proc.stderr
