"""`kvstate serve`: without a model or a bundled one it says what to pass (one line, exit 2); a busy
port is one line before any model loads; a real process on a free loopback port answers the
OpenAI client, reports prefix-cache hits in /metrics, and stops cleanly on SIGTERM."""

import os
import re
import signal
import socket
import subprocess
import sys

import pytest

httpx = pytest.importorskip("httpx")

from kvstate.cli import main  # noqa: E402


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_without_a_model_says_what_to_pass(capsys, monkeypatch, tmp_path):
    from kvstate.commands import serve

    monkeypatch.setattr(serve, "BUNDLED_MODELS", tmp_path / "none")
    assert main(["serve"]) == 2
    assert "pass --model" in _one_line(capsys)


def test_a_bundled_model_is_the_default(monkeypatch, tmp_path):
    from kvstate.commands import serve

    monkeypatch.setattr(serve, "BUNDLED_MODELS", tmp_path)
    (tmp_path / "a-config-only").mkdir()
    (tmp_path / "a-config-only" / "config.json").write_text("{}")
    assert serve.bundled_model() is None  # no weights: not a model
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"")
    assert serve.bundled_model() == tmp_path / "tiny"


def test_a_busy_port_is_one_line(capsys, checkpoint):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(checkpoint), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in _one_line(capsys)


def test_connections_send_without_nagle():
    """Accepted connections inherit TCP_NODELAY (else a kept-alive connection waits 40 ms a reply)."""
    from kvstate.commands import serve

    with serve.listen("127.0.0.1", 0) as sock:
        sock.listen()
        with socket.create_connection(sock.getsockname()) as client:
            conn, _ = sock.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            client.close()


def test_serve_process_answers_and_stops(checkpoint):
    openai = pytest.importorskip("openai")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvstate", "serve", "--model", str(checkpoint), "--port", "0",
                             "--max-model-len", "128", "--cache-memory", "8MiB", "--served-model-name", "tiny",
                             "--enable-prefix-caching"],
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stderr.readline()  # the URL line, once the model is loaded
        url = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert url, line
        for _ in range(200):  # uvicorn starts serving just after the line
            try:
                if httpx.get(url[0] + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
        with openai.OpenAI(base_url=url[0] + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            out = client.completions.create(model="tiny", prompt="hybrid", max_tokens=3, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.usage.completion_tokens == 3
            # the same 49 tokens three times: the second and the third resume at its last token
            prompt = list(range(3, 52))
            for _ in range(3):
                client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        metrics = httpx.get(url[0] + "/metrics", timeout=10).text
        hits = re.search(r"^kvstate_prefix_hits_total (\S+)$", metrics, re.M)
        assert hits and float(hits[1]) >= 1, metrics
    finally:
        proc.terminate()
        try:
            rc = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    # uvicorn shuts down gracefully, then re-raises the signal it caught (its documented behavior)
    assert rc in (0, -signal.SIGTERM)
    assert "Traceback" not in proc.stderr.read()


def test_help_lists_the_limits_and_the_key(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--api-key", "KVSTATE_API_KEY", "--max-body-bytes", "--max-prompt-chars",
                 "--max-sequences-per-request", "--metrics-key", "KVSTATE_METRICS_KEY", "--timeout-idle",
                 "--timeout-graceful-shutdown", "--explorer-bench-run"):
        assert flag in out, flag


@pytest.mark.parametrize("value", ["0", "-1", "soon", "1e9"])
def test_a_bad_timeout_is_one_line_and_exit_2(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--timeout-idle", value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--timeout-idle" in err and "Traceback" not in err
