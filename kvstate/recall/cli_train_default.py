"""`kvstate recall train-default`: train the two shipped models (kvstate-phonebook-hybrid and -linear).

The two models train at once, each in its own process on one CPU thread (tiny matrices gain
nothing from a second thread; two processes use both cores fully), seeded, so a rerun gives the
same weights. A rich progress bar per model shows its running loss and exact-answer accuracy;
at the end two tables give each model's phonebook accuracy at 1 to 64 entries and its exact
repeats of passages of 4, 16 and 64 words (teacher-forced argmax, which equals greedy decoding).
The checkpoints go to the package's kvstate/data/models/<name>/ unless `--out DIR` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvstate.terminal.arg_types import count_arg, seed_arg, whole_number


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write <DIR>/<name>/ (default: the package's kvstate/data/models)")
    parser.add_argument("--steps", type=count_arg, default=None,
                        help="optimiser steps per model after the copy stage (default: the recipe's)")
    parser.add_argument("--copy-steps", type=whole_number(0), default=None,
                        help="a copy stage of at most N steps of short passages, then at most N of long ones "
                             "(default: the recipe's, 3000 and 600; 0: no copy stage)")
    parser.add_argument("--only", choices=("hybrid", "linear"), default=None, help="train one of the two models")
    parser.add_argument("--layers", metavar="STRING", default=None,
                        help="train one model of this layer string instead (G: Gated DeltaNet, A: attention; "
                             "e.g. AAAA), with the same recipe, into <out>/phonebook-<STRING>; needs --out")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of weights and data (default: 0)")
    parser.add_argument("--json", action="store_true", help="print the accuracies as JSON (no progress bar)")


def _worker(name: str, recipe, out: str, queue, layers: dict | None = None) -> None:
    import torch

    from kvstate.recall.train_default import train_default

    torch.set_num_threads(1)
    try:
        results = train_default(Path(out), recipe, names=(name,), layers=layers,
                                on_step=lambda n, i, loss, acc, total: queue.put(("step", n, i, loss, acc, total)))
        queue.put(("done", name, results[name]))
    except BaseException as exc:  # reported by the parent as one line
        queue.put(("error", name, f"{type(exc).__name__}: {exc}"))


def run(args: argparse.Namespace) -> int:
    import multiprocessing as mp

    from kvstate.terminal.console import make_console
    from kvstate.errors import KvstateError
    from kvstate.recall.train_default import LAYERS, DefaultRecipe
    from kvstate.shipped import models_dir

    recipe = DefaultRecipe(seed=args.seed)
    if args.steps is not None:
        recipe = replace(recipe, train=replace(recipe.train, steps=args.steps))
    if args.copy_steps is not None:
        recipe = replace(recipe, train=replace(recipe.train, copy_first=args.copy_steps,
                                               copy_long=min(recipe.train.copy_long, args.copy_steps)))
    names = [n for n in LAYERS if args.only is None or n.endswith(args.only)]
    extra = None
    if args.layers is not None:
        if not args.layers or set(args.layers) - set("GA") or len(args.layers) > 16:
            raise KvstateError(f"--layers: 1 to 16 letters G (Gated DeltaNet) or A (attention), got {args.layers!r}")
        if args.out is None or args.only is not None:
            raise KvstateError("--layers trains a model that is not shipped: give --out DIR (and no --only)")
        names, extra = [f"phonebook-{args.layers}"], {f"phonebook-{args.layers}": args.layers}
    out = Path(args.out) if args.out else models_dir()
    console = make_console()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(n, recipe, str(out), queue, extra), daemon=True) for n in names]
    for p in procs:
        p.start()
    results, errors = {}, {}
    total = recipe.train.copy_first + recipe.train.copy_long + recipe.train.steps  # until the copy stage ends
    with _progress(console, names, total, enabled=not args.json) as update:
        while len(results) + len(errors) < len(names):
            msg = queue.get()
            if msg[0] == "step":
                update(*msg[1:])
            elif msg[0] == "done":
                results[msg[1]] = msg[2]
            else:
                errors[msg[1]] = msg[2]
    for p in procs:
        p.join()
    if errors:
        name, text = next(iter(errors.items()))
        raise KvstateError(f"training {name} failed: {text}")
    if args.json:
        json.dump({n: {k: {str(e): a for e, a in v.items()} for k, v in r.items()} for n, r in results.items()},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _table(console, results, out)
    return 0


def _progress(console, names, steps, *, enabled: bool):
    from contextlib import contextmanager

    @contextmanager
    def bar():
        if not enabled:
            yield lambda *a: None
            return
        if not console.is_terminal:  # a log file: one line per model every 25 steps instead of a bar
            def line(name, i, loss, acc, total):
                if (i + 1) % 25 == 0 or i + 1 == total:
                    console.print(f"{name} step {i + 1}/{total} loss {loss:.3f} acc {acc:.2f}")
            yield line
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]:.3f}  acc {task.fields[acc]:.2f}"), TimeRemainingColumn(),
                      console=console) as progress:
            tasks = {n: progress.add_task(n, total=steps, loss=float("nan"), acc=0.0) for n in names}

            def update(name, i, loss, acc, total):
                acc = acc if acc == acc else progress.tasks[tasks[name]].fields["acc"]  # nan: no phonebook in batch
                progress.update(tasks[name], completed=i + 1, total=total, loss=loss, acc=acc)

            yield update

    return bar()


def _table(console, results, out: Path) -> None:
    from rich.table import Table

    for key, title, unit in (("phonebook", "phonebook accuracy (exact answer) by book size", "entries"),
                             ("copy", "copy accuracy (exact repeat) by passage length", "words")):
        sizes = sorted({e for r in results.values() for e in r[key]})
        table = Table(title=title)
        table.add_column("model")
        for e in sizes:
            table.add_column(f"{e} {unit}", justify="right")
        for name, r in results.items():
            table.add_row(name, *(f"{r[key][e]:.0%}" for e in sizes))
        console.print(table)
    console.print(f"saved under {out}")
