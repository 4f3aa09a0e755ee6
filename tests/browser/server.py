"""A live explorer on loopback for the explorer's tests: a tiny random Qwen3.5 checkpoint with a
tiny trained BPE tokenizer (as the engine tests use), served by `create_app` with the explorer's
router, by uvicorn in a thread on a free port.

Prefill chunks of 64 tokens (max_num_batched_tokens) so that a longer prompt takes several real
engine steps, and a 1024-token window so that the recall prompts fit.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import socket
import threading
import time
from pathlib import Path

MODEL_NAME = "tiny-qwen3.5"
MAX_MODEL_LEN = 1024
CHUNK = 64  # max_num_batched_tokens: a prompt longer than this prefills in several steps


def write_checkpoint(path: Path) -> Path:
    from tests.engine.test_engine import tiny_qwen3_5
    from tests.models.test_tokenizer import write_tokenizer

    tiny_qwen3_5(vocab=300).save_pretrained(path)  # the tokenizer's 300 tokens
    write_tokenizer(path)
    return path


def explorer_app(path: Path):
    """The served app: OpenAI routes, the explorer's API and its static page."""
    from kvstate import LLM
    from kvstate.server import explorer
    from kvstate.server.app import create_app

    llm = LLM(path, cache_memory="16MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=CHUNK)
    return create_app(llm, model_name=MODEL_NAME, routers=[explorer.router])


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 on a free port, in a daemon thread; yields the base URL."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def wait_idle(app, timeout: float = 30.0) -> dict:
    """The engine loop's stats once nothing is running, waiting or queued."""
    loop = app.state.engine_loop
    deadline = time.monotonic() + timeout
    while True:
        stats = loop.stats()
        if not (stats["num_running"] or stats["num_waiting"] or stats["num_pending"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
