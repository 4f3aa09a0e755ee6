"""A live explorer on loopback for the explorer's tests: a tiny random Qwen3.5 checkpoint with a
tiny trained BPE tokenizer (as the engine tests use), served by `create_app` with the explorer's
router, by uvicorn in a thread on a free port.

Prefill chunks of 64 tokens (max_num_batched_tokens) so that a longer prompt takes several real
engine steps, and a 1024-token window so that the recall prompts fit.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

from tests.live_server import ServerThread, write_checkpoint  # noqa: F401 (re-exported for conftest)
from tests.live_server import wait_idle as wait_loop_idle

MODEL_NAME = "tiny-qwen3.5"
MAX_MODEL_LEN = 1024
CHUNK = 64  # max_num_batched_tokens: a prompt longer than this prefills in several steps


def explorer_app(path: Path):
    """The served app: OpenAI routes, the explorer's API and its static page."""
    from kvstate import LLM
    from kvstate.server import explorer
    from kvstate.server.app import create_app

    llm = LLM(path, cache_memory="16MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=CHUNK)
    return create_app(llm, model_name=MODEL_NAME, routers=[explorer.router])


def explorer_client(path: Path):
    """A TestClient over `explorer_app(path)` for the length of a fixture (`yield from`); the app
    is `client.app_ref`."""
    from fastapi.testclient import TestClient

    app = explorer_app(path)
    with TestClient(app) as client:
        client.app_ref = app
        yield client


def wait_idle(app, timeout: float = 30.0) -> dict:
    """The app's engine loop stats once nothing is running, waiting or queued."""
    return wait_loop_idle(app.state.engine_loop, timeout)
