"""A live `kvstate serve` app on loopback for the server tests: a tiny random Qwen3.5 checkpoint
with a tiny trained BPE tokenizer (as the engine tests use), served by uvicorn in a thread on a
free port. `live_server` is shared by the whole session (one model, one engine loop)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import socket
import threading
import time
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MAX_MODEL_LEN = 256
MODEL_NAME = "tiny-qwen3.5"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from tests.engine.test_engine import tiny_qwen3_5
    from tests.models.test_tokenizer import write_tokenizer

    path = tmp_path_factory.mktemp("serve")
    tiny_qwen3_5(vocab=300).save_pretrained(path)  # the tokenizer's 300 tokens
    write_tokenizer(path)
    return path


def make_llm(path):
    from kvstate import LLM

    return LLM(path, cache_memory="16MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    app: object
    loop: object  # the EngineLoop

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 on a free port, in a daemon thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture(scope="session")
def live_server(checkpoint):
    from kvstate.server.app import create_app

    app = create_app(make_llm(checkpoint), model_name=MODEL_NAME)
    with ServerThread(app) as url:
        yield LiveServer(url, app, app.state.engine_loop)


@pytest.fixture(scope="session")
def reference_llm(checkpoint):
    """A second engine on the same checkpoint for LLM.generate (the served one belongs to its loop)."""
    return make_llm(checkpoint)


def wait_idle(loop, timeout: float = 20.0) -> dict:
    """The loop's stats once no request is running, waiting or queued (aborts land a step later)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = loop.stats()
        if not (stats["num_running"] or stats["num_waiting"] or stats["num_pending"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
