"""Issue #41's shutdown and idle connections against a real `kvstate serve` process (the shipped
hybrid, loopback only): a socket that never finishes its request head, or stops halfway through a
body, is closed after --timeout-idle; SIGTERM with 16 streams open, a half-sent body and a client
that stopped reading ends the process within 5 s, every stream told why (an event naming the
shutdown, then [DONE]) or cut; a client that stops reading an n=4 x 4000-token stream is aborted long
before its tokens are all generated."""

import signal
import socket
import threading
import time

import pytest

from tests.live_server import start_serve

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.xdist_group("hostile_shutdown")
STREAM = b'{"prompt": "The phone book", "max_tokens": 1500, "ignore_eos": true, "stream": true}'


def _serve(*flags):
    proc, url = start_serve("--max-model-len", "2048", "--cache-memory", "64MiB", *flags)
    host, port = url.removeprefix("http://").split(":")
    return proc, (host, int(port))


def _post(addr, body: bytes, *, send: bytes | None = None, rcvbuf: int | None = None) -> socket.socket:
    """A raw POST /v1/completions; `send`: only these bytes of the body (a client that stalls)."""
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(addr)
    sock.settimeout(15)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {addr[0]}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + (body if send is None else send))
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (EOF or reset) within `seconds`, reading whatever comes first."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            continue
        except ConnectionError:
            return True
    return False


def test_stalled_requests_are_closed_and_sigterm_ends_16_streams_in_5_s():
    proc, addr = _serve("--timeout-idle", "1.5", "--timeout-graceful-shutdown", "3")
    try:
        silent = socket.create_connection(addr)  # connects, sends nothing
        half_head = socket.create_connection(addr)
        half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        stalled = _post(addr, STREAM, send=STREAM[:20])
        for sock in (silent, half_head, stalled):
            assert _closed_within(sock, 6), "a stalled connection stayed open past --timeout-idle"
            sock.close()

        streams = [_post(addr, STREAM) for _ in range(16)]
        for sock in streams:
            assert b"200 OK" in sock.recv(65536)  # each has started (head and first events)
        deaf = _post(addr, STREAM, rcvbuf=4096)  # never read again
        half_body = _post(addr, STREAM, send=STREAM[:30])  # the body stops halfway, until SIGTERM
        time.sleep(0.5)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        tails = [b""] * len(streams)

        def read_rest(i):
            try:
                while chunk := streams[i].recv(65536):
                    tails[i] = (tails[i] + chunk)[-4096:]
            except OSError:
                pass

        readers = [threading.Thread(target=read_rest, args=(i,), daemon=True) for i in range(len(streams))]
        for t in readers:
            t.start()
        rc = proc.wait(timeout=30)
        took = time.monotonic() - start
        for t in readers:
            t.join(5)
        print(f"\nSIGTERM with 16 streams, an unread stream and a half-sent body: exit {rc} after {took:.2f} s")
        assert took <= 5.0
        told = sum(b"shutting down" in tail and b"[DONE]" in tail for tail in tails)
        assert told == len(streams), [tail[-200:] for tail in tails]
        for sock in (*streams, deaf, half_body):
            sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_client_that_stops_reading_is_aborted_before_its_stream_is_all_generated():
    proc, addr = _serve("--max-model-len", "4096", "--cache-memory", "256MiB")  # the last of a flag wins
    url = f"http://{addr[0]}:{addr[1]}"
    try:
        body = (b'{"prompt": "The phone book", "max_tokens": 4000, "ignore_eos": true, "stream": true, "n": 4, '
                b'"logprobs": 5}')
        deaf = _post(addr, body, rcvbuf=4096)  # reads nothing: its socket fills, then the backlog
        metrics = {}
        assert _until_idle(url, metrics, 120), metrics
        print(f"\nan unread n=4 x 4000-token stream with logprobs: {metrics['kvstate_generation_tokens_total']:.0f} "
              f"of {4 * 4000} tokens generated, then aborted")
        assert metrics["kvstate_generation_tokens_total"] < 0.75 * 4 * 4000  # (the socket buffers take ~1,500 each)
        deaf.close()
    finally:
        proc.terminate()
        proc.wait(30)


def _until_idle(url: str, metrics: dict, seconds: float) -> bool:
    """Wait (fill `metrics`) until the engine has started and then runs nothing."""
    deadline, started = time.monotonic() + seconds, False
    while time.monotonic() < deadline:
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                metrics[name] = float(value)
        started = started or metrics.get("kvstate_num_running", 0) > 0
        if started and metrics["kvstate_num_running"] == 0 and metrics["kvstate_num_waiting"] == 0:
            return True
        time.sleep(0.2)
    return False
