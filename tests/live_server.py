"""A live app on loopback for the server, explorer and browser tests: a tiny random Qwen3.5
checkpoint with a tiny trained BPE tokenizer (as the engine tests use), served by uvicorn in a
daemon thread on a free port; or a `kvstate serve` process (`start_serve`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def write_checkpoint(path: Path) -> Path:
    """A tiny Qwen3.5 checkpoint with the tokenizer's 300 tokens."""
    from tests.engine.test_engine import tiny_qwen3_5
    from tests.models.test_tokenizer import write_tokenizer

    tiny_qwen3_5(vocab=300).save_pretrained(path)
    write_tokenizer(path)
    return path


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 on a free port, in a daemon thread; `with` yields the base URL."""

    def __init__(self, app, start_timeout: float = 60.0):
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.start_timeout = start_timeout
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


def wait_idle(loop, timeout: float = 30.0) -> dict:
    """An EngineLoop's stats once no request is running, waiting or queued (aborts land a step later)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = loop.stats()
        if not (stats["num_running"] or stats["num_waiting"] or stats["num_pending"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def start_serve(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    """`kvstate serve --port 0 FLAGS` (the shipped model, loopback) once /health answers: (process, URL);
    its stderr is drained by a thread after the URL line."""
    import httpx

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "kvstate", "serve", "--port", "0", *flags],
                            stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    url = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not url:
        proc.kill()
    assert url, line
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    for _ in range(400):
        try:
            if httpx.get(url[0] + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.05)
    return proc, url[0]
