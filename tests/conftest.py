"""Test-wide settings: offline transformers, and one torch thread per pytest worker; and the
compiled kernels' line in the terminal summary (tests/kernel_paths.py: xdist workers send their
counters to the controller, which prints the sum).

`make test` runs two xdist workers on the two cores; more threads per worker only oversubscribe
the machine (tiny ops then take milliseconds instead of microseconds).
"""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch
except ImportError:  # the torch-free parts can still be tested
    torch = None

kernel_paths = None
if torch is not None:
    torch.set_num_threads(1)
    from tests import kernel_paths

_worker_states: list[dict] = []


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and kernel_paths is not None:
        workeroutput["kvstate_kernels"] = json.dumps(kernel_paths.snapshot())


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    text = getattr(node, "workeroutput", {}).get("kvstate_kernels")
    if text:
        _worker_states.append(json.loads(text))


def pytest_terminal_summary(terminalreporter, config):
    if kernel_paths is None or hasattr(config, "workeroutput"):
        return
    state = kernel_paths.merge(_worker_states) if _worker_states else kernel_paths.snapshot()
    terminalreporter.write_line(kernel_paths.line(state))
