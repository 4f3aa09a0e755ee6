"""The `kvstate` command line: parse, call the library, print.

Each subcommand lives in `kvstate.commands.<name>` with `configure(parser)` and `run(args)`.
Command modules import nothing heavy at module level, so `kvstate --help` and torch-free
commands such as `kvstate memory` start instantly; torch is imported inside `run` when needed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kvstate import __version__
from kvstate.errors import KvstateError

# name -> one-line help; the module kvstate.commands.<name> implements it.
COMMANDS: dict[str, str] = {
    "memory": "per-request KV and fixed-state bytes of hybrid models (torch-free)",
    "generate": "stream a completion from a checkpoint with the engine (paged KV + state slots)",
    "bench": "benchmarks: ops, model, engine (ratios against transformers, fraction of machine limits)",
    "serve": "OpenAI-compatible HTTP server over the engine, with the cache explorer at / (loopback by default)",
    "recall": "recall on CPU: train tiny models on MQAR / phonebook, sweep them, run the phonebook test",
    "eval": "quality: perplexity over sliding windows, KL and top-1 agreement against a base (llama-perplexity)",
}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (its default prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstate",
        description="Run, measure and understand hybrid LLMs (full attention + linear/SSM layers).",
    )
    parser.add_argument("--version", action="version", version=f"kvstate {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<subcommand>")
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"kvstate.commands.{name}")
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # The reader went away (`kvstate memory | head -1`): not an error. Point stdout at devnull
        # so the interpreter's last flush cannot fail again (Python docs, "Note on SIGPIPE").
        _quiet_stdout()
        return 0


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 0
    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here, not at exit
        return code
    except KvstateError as exc:
        print(f"kvstate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _quiet_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (e.g. stdout captured by a test)
        pass


if __name__ == "__main__":
    raise SystemExit(main())
