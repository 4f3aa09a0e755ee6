"""`kvstate serve [--model PATH_OR_HUB_ID] [--host 127.0.0.1] [--port 8000]`: the OpenAI-compatible
server (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) and the cache
explorer at `/`, over one engine stepped by one background loop.

Loopback by default; exposing it is an explicit --host, best with --api-key (or KVSTATE_API_KEY):
then /v1, the explorer's API and /metrics need `Authorization: Bearer KEY` (/metrics: --metrics-key
if given; /health stays open). Stalled request heads and bodies are closed (--timeout-idle); SIGTERM
ends running requests at once (--timeout-graceful-shutdown; kvstate.server.http_timeouts).
What one request may ask is bounded (--max-body-bytes, --max-prompt-chars,
--max-sequences-per-request; see kvstate.server.limits). The port is bound before the model
loads, so a busy port is one line at once; --port 0 takes any free port (the URL line on stderr
says which).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from kvstate.terminal.arg_types import count_arg
from kvstate.terminal.engine_args import add_engine_args, add_speculative_args
from kvstate.errors import KvstateError
from kvstate.server.limits import (ACCEPT_BACKLOG, CHARS_PER_TOKEN, DEFAULT_GRACEFUL_SHUTDOWN, DEFAULT_IDLE_TIMEOUT,
                                   DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_SEQUENCES)

BUNDLED_MODELS = Path(__file__).resolve().parent.parent / "data" / "models"  # <name>/config.json + weights


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0 (any free port) to 65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < 86400:
        raise argparse.ArgumentTypeError(f"must be more than 0 and less than a day, got {text}")
    return value


# the EngineConfig fields serve takes as options (kvstate.engine.config documents each)
ENGINE_ARGS = ("cache_memory", "max_model_len", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens",
               "enable_prefix_caching", "snapshot_interval", "snapshot_memory", "seed", "weight_dtype",
               "activation_dtype")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, metavar="PATH_OR_HUB_ID",
                        help="checkpoint directory (config.json, *.safetensors, tokenizer.json), a Hugging Face "
                             "hub id, or a shipped model's name (default: kvstate-phonebook-hybrid)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; elsewhere, set --api-key)")
    parser.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 = any free port (default: 8000)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model's name in the API (default: the --model argument's last path part)")
    add_engine_args(parser, ENGINE_ARGS)
    add_speculative_args(parser)
    parser.add_argument("--bench-json", default=None, metavar="FILE",
                        help="a saved `kvstate bench engine --json` result: the explorer's prefill/decode "
                             "timeline at real scale (the page can also take an upload)")
    parser.add_argument("--explorer-bench-run", action="store_true",
                        help="let the explorer page start `kvstate bench engine` (a subprocess of several GB, "
                             "one at a time); off: it takes an uploaded result only")
    limits = parser.add_argument_group("limits and access (what one client may ask)")
    limits.add_argument("--api-key", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1, the explorer's API and /metrics (401 "
                             "without it; /metrics: --metrics-key if given; /health stays open; the explorer page "
                             "takes it as ?key=KEY) "
                             "(default: $KVSTATE_API_KEY, else none)")
    limits.add_argument("--max-body-bytes", type=count_arg, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help=f"largest request body; larger is a 413 before it is read "
                             f"(default: {DEFAULT_MAX_BODY_BYTES}, "
                             f"{DEFAULT_MAX_BODY_BYTES >> 20} MiB)")
    limits.add_argument("--max-prompt-chars", type=count_arg, default=None, metavar="N",
                        help=f"longest prompt text (a chat: its messages together); longer is a 400 before "
                             f"tokenizing (default: {CHARS_PER_TOKEN} x --max-model-len)")
    limits.add_argument("--max-sequences-per-request", type=count_arg, default=DEFAULT_MAX_SEQUENCES, metavar="N",
                        help=f"most prompts x n in one request (each is one engine request; requests are "
                             f"admitted in turn, so a large one cannot starve the others); at most half of "
                             f"--max-num-seqs, so that one request never takes every running place "
                             f"(default: {DEFAULT_MAX_SEQUENCES})")
    limits.add_argument("--metrics-key", default=None, metavar="KEY",
                        help="the key /metrics needs as 'Authorization: Bearer KEY' (a scraper's own) "
                             "(default: $KVSTATE_METRICS_KEY, else the --api-key; with neither, /metrics is open)")
    limits.add_argument("--timeout-idle", type=_seconds, default=DEFAULT_IDLE_TIMEOUT, metavar="S",
                        help=f"close a connection whose request head or body stalls this long "
                             f"(default: {DEFAULT_IDLE_TIMEOUT:g})")
    limits.add_argument("--timeout-graceful-shutdown", type=_seconds, default=DEFAULT_GRACEFUL_SHUTDOWN,
                        metavar="S", help=f"on SIGTERM, running requests are ended at once (a stream gets an "
                                          f"error event); whatever still hangs is cancelled after this long "
                                          f"(default: {DEFAULT_GRACEFUL_SHUTDOWN:g})")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default: warning)")


def bundled_model() -> Path | None:
    """The project's default model: kvstate-phonebook-hybrid (kvstate.shipped) when its weights are
    under kvstate/data/models, else the first checkpoint with weights there."""
    from kvstate.shipped import DEFAULT_MODEL

    if not BUNDLED_MODELS.is_dir():
        return None
    default = BUNDLED_MODELS / DEFAULT_MODEL
    for path in [default, *sorted(BUNDLED_MODELS.iterdir())]:
        if (path / "config.json").exists() and any(path.glob("*.safetensors")):
            return path
    return None


def listen(host: str, port: int) -> socket.socket:
    """A bound socket (IPv4 or IPv6 by the host's form); a busy port or a bad host is one line.
    TCP_NODELAY, which accepted connections inherit: uvicorn writes a reply's headers and body
    apart, and on a kept-alive connection Nagle then holds the body for the client's delayed ACK
    (40 ms a request for a Python client such as lm-evaluation-harness's; 1 ms with it set)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise KvstateError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def raise_fd_limit() -> None:
    """Let the process open as many sockets as the system allows (the soft limit is often 1024)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 16, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: keep the limit
        pass


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from kvstate.server.app import create_app  # noqa: F401 - only whether the serve extra is installed
        from kvstate.server.http_timeouts import ServeServer, protocol_with
    except ImportError as exc:
        raise KvstateError(f"kvstate serve needs the serve extra ({exc.name} is missing): "
                           f"pip install 'kvstate[serve]'") from None
    model = args.model or bundled_model()
    if model is None:
        raise KvstateError("no model is bundled yet: pass --model PATH_OR_HUB_ID (a checkpoint directory with "
                           "config.json, *.safetensors and tokenizer.json, or a Hugging Face hub id)")
    sock = listen(args.host, args.port)
    try:
        app = _app(args, model)
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        print(f"kvstate serve: {app.state.engine_loop.model_name} on http://{shown}:{port} "
              f"(OpenAI API /v1, explorer /, metrics /metrics)", file=sys.stderr, flush=True)
        raise_fd_limit()
        config = uvicorn.Config(app, log_level=args.log_level, lifespan="on", http=protocol_with(args.timeout_idle),
                                timeout_graceful_shutdown=args.timeout_graceful_shutdown, backlog=ACCEPT_BACKLOG)
        ServeServer(config, app.state.engine_loop).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def _app(args: argparse.Namespace, model):
    from kvstate.terminal.console import make_console
    from kvstate.terminal.engine_args import engine_config
    from kvstate.terminal.progress import load_progress
    from kvstate.llm import LLM
    from kvstate.engine.config import EngineConfig
    from kvstate.hub import resolve_checkpoint
    from kvstate.server.app import create_app
    from kvstate.server.limits import ServerLimits

    routers = []
    try:
        from kvstate.server import explorer

        routers.append(explorer.router)
    except ImportError:  # the explorer's API is optional: the OpenAI routes serve without it
        pass
    config = EngineConfig(**engine_config(args, ENGINE_ARGS))  # a bad flag fails before the weights load
    bench = read_bench_json(args.bench_json) if args.bench_json else None
    path = resolve_checkpoint(model)
    with load_progress(make_console(stderr=True)) as progress:
        llm = LLM(path, load_progress=progress, config=config)
    if args.served_model_name:
        name = args.served_model_name
    else:  # a local checkpoint by its folder name, a hub id as given
        name = Path(model).resolve().name if Path(str(model)).exists() else str(model)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                          max_sequences=args.max_sequences_per_request)
    api_key = args.api_key if args.api_key is not None else os.environ.get("KVSTATE_API_KEY") or None
    metrics_key = args.metrics_key if args.metrics_key is not None else os.environ.get("KVSTATE_METRICS_KEY")
    app = create_app(llm, model_name=name, routers=routers, limits=limits, api_key=api_key,
                     metrics_key=metrics_key or None)
    app.state.explorer_bench = bench
    app.state.explorer_bench_runs = args.explorer_bench_run
    return app


def read_bench_json(path: str) -> dict:
    """A saved bench result the explorer can use; one line when it is not one."""
    import json

    from kvstate.server.explorer_scale import scenario

    try:
        bench = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise KvstateError(f"--bench-json {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        scenario(bench)
    except KvstateError as exc:
        raise KvstateError(f"--bench-json {path}: {exc}") from None
    return bench
