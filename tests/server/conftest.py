"""A live `kvstate serve` app on loopback for the server tests: a tiny random Qwen3.5 checkpoint
with a tiny trained BPE tokenizer (as the engine tests use), served by uvicorn in a thread on a
free port. `live_server` is shared by the whole session (one model, one engine loop)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.live_server import ServerThread, wait_idle, write_checkpoint  # noqa: E402,F401 (wait_idle for the tests)

MAX_MODEL_LEN = 256
MODEL_NAME = "tiny-qwen3.5"


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("serve"))


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
