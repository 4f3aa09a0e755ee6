"""lm-evaluation-harness end to end against `kvstate serve` (a subprocess), as a user runs it:
`local-completions` with lm-eval's default tokenizer backend (it finds /tokenizer_info and
/tokenize and tokenizes through the server; HF_HUB_OFFLINE=1, so a hub download would fail),
on kvstate's local tasks (kvstate/data/lm_eval): 8-entry phone books as multiple choice of 4
numbers (loglikelihood over echo), the same books generated (generate_until), and copy chats
scored whole (loglikelihood_rolling). The shipped hybrid answers the multiple choice (>= 0.9);
its all-linear twin, whose fixed state cannot hold 8 entries, is far lower."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
httpx = pytest.importorskip("httpx")

TASKS = Path(__file__).resolve().parents[2] / "kvstate" / "data" / "lm_eval"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, port: int):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", "kvstate", "serve", "--model", model, "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait(proc, port: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvstate serve exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.3)
    raise AssertionError("kvstate serve did not answer /health in 120 s")


def _evaluate(model: str, port: int) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"http://127.0.0.1:{port}/v1/completions",
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["kvstate_phonebook_mc", "kvstate_phonebook_gen", "kvstate_copy_rolling"],
        task_manager=TaskManager(include_path=str(TASKS), include_defaults=False), limit=10)
    return out["results"]


@pytest.fixture(scope="module")
def results(monkeypatch_module):
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    servers = {m: (_free_port(), None) for m in ("kvstate-phonebook-hybrid", "kvstate-phonebook-linear")}
    servers = {m: (port, _serve(m, port)) for m, (port, _) in servers.items()}  # both start at once
    try:
        for port, proc in servers.values():
            _wait(proc, port)
        return {m: _evaluate(m, port) for m, (port, _) in servers.items()}
    finally:
        for _, proc in servers.values():
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.slow
def test_hybrid_answers_the_multiple_choice_and_linear_does_not(results):
    hybrid = results["kvstate-phonebook-hybrid"]
    linear = results["kvstate-phonebook-linear"]
    assert hybrid["kvstate_phonebook_mc"]["acc,none"] >= 0.9
    assert linear["kvstate_phonebook_mc"]["acc,none"] <= hybrid["kvstate_phonebook_mc"]["acc,none"] - 0.4
    assert hybrid["kvstate_phonebook_gen"]["exact_match,none"] >= 0.9
    assert linear["kvstate_phonebook_gen"]["exact_match,none"] < hybrid["kvstate_phonebook_gen"]["exact_match,none"]


@pytest.mark.slow
def test_rolling_loglikelihood_is_scored(results):
    hybrid = results["kvstate-phonebook-hybrid"]["kvstate_copy_rolling"]
    linear = results["kvstate-phonebook-linear"]["kvstate_copy_rolling"]
    assert 1 < hybrid["byte_perplexity,none"] < 1321  # fewer bits than a uniform guess over the vocabulary
    assert hybrid["bits_per_byte,none"] < linear["bits_per_byte,none"]  # attention copies the passage better
