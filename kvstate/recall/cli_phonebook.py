"""`kvstate recall phonebook --model PATH|NAME`: exact recall against book size, through the engine.

Runs `phonebook_eval.phonebook_curve` on any loadable checkpoint with a tokenizer (a directory,
a hub id, or a shipped model's name; default: kvstate-phonebook-hybrid) and prints a table of
accuracy, prompt length, KV bytes and state bytes per book size; `--plot FILE` draws the curve,
`--json` prints the rows (keys: entries, prompt_tokens, accuracy, kv_bytes, state_bytes). `--model`
repeated compares models: a table each, one plot, and JSON as name -> rows. `--weight-dtype` as
`generate` takes it (int8: recall with quantized projections).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstate.terminal.arg_types import count_arg, seed_arg

DEFAULT_SIZES = "4,8,16,32,64"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=None, metavar="PATH_OR_NAME",
                        help="checkpoint directory, hub id or shipped model name; repeat it to compare models in one "
                             "table and plot (default: kvstate-phonebook-hybrid)")
    parser.add_argument("--entries", default=DEFAULT_SIZES, metavar="N,N,...",
                        help=f"book sizes (default: {DEFAULT_SIZES})")
    parser.add_argument("--queries", type=count_arg, default=32, metavar="N",
                        help="books (one question each) per size (default: 32)")
    parser.add_argument("--digits", type=count_arg, default=4, metavar="N", help="digits per number (default: 4)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the books (default: 0)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="write accuracy vs book size (.png or .svg)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (no progress bar)")
    from kvstate.terminal.engine_args import add_weight_dtype

    add_weight_dtype(parser)  # e.g. int8: does the model still recall exactly with quantized projections?


def run(args: argparse.Namespace) -> int:
    from kvstate.terminal.console import make_console
    from kvstate.terminal.number_list import number_list
    from kvstate.terminal.plot_path import check_plot_path
    from kvstate.errors import KvstateError
    from kvstate.hub import resolve_checkpoint
    from kvstate.shipped import DEFAULT_MODEL

    sizes = number_list("--entries", args.entries, int, 1, 520)  # book sizes
    if args.digits > 12:  # (counts below 1 are refused when parsed)
        raise KvstateError(f"--digits: from 1 to 12, got {args.digits}")
    if args.plot:
        check_plot_path(args.plot)  # before the models run, not after
    names = args.model or [DEFAULT_MODEL]
    paths = [resolve_checkpoint(name) for name in names]  # every model checked before any runs
    for name, path in zip(names, paths):
        if not (path / "tokenizer.json").is_file():
            raise KvstateError(f"{name}: no tokenizer.json (the phonebook test writes and reads text)")
    from kvstate.llm import LLM
    from kvstate.recall.phonebook_eval import phonebook_curve, plot_curve

    console = make_console(stderr=True)
    curves: dict[str, list[dict]] = {}
    for name, path in zip(names, paths):
        llm = LLM(path, seed=args.seed, weight_dtype=args.weight_dtype)
        try:
            with _bar(console, str(name), len(sizes), enabled=not args.json) as advance:
                curves[str(name)] = phonebook_curve(llm, sizes, queries=args.queries, seed=args.seed,
                                                    digits=args.digits, progress=advance)
        finally:
            llm.close()
    if args.plot:
        plot_curve(curves, args.plot)
    if args.json:  # one model: its rows; several: name -> rows
        json.dump(next(iter(curves.values())) if len(curves) == 1 else curves, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = make_console()
    for name, rows in curves.items():
        _table(out, name, rows)
    if args.plot:
        out.print(f"plot written to {args.plot}")
    return 0


def _bar(console, name: str, total: int, *, enabled: bool):
    from contextlib import contextmanager

    @contextmanager
    def bar():
        if not enabled or not console.is_terminal:
            yield lambda entries: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        with Progress(TextColumn(f"phonebook {name}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[at]}"), console=console, transient=True) as progress:
            task = progress.add_task("sizes", total=total, at="")
            yield lambda entries: progress.update(task, advance=1, at=f"{entries} entries done")

    return bar()


def _table(console, name: str, rows: list[dict]) -> None:
    from rich.table import Table

    from kvstate.memory import format_bytes

    table = Table(title=f"phonebook recall of {name} (greedy, through the engine)")
    for col in ("entries", "prompt tokens", "exact answers", "KV cache", "state"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["entries"]), str(r["prompt_tokens"]), f"{r['accuracy']:.0%}",
                      format_bytes(r["kv_bytes"]), format_bytes(r["state_bytes"]))
    console.print(table)
