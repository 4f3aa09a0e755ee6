"""`kvstate recall train-mtp`: train the MTP head of a shipped phonebook model, then measure what it buys.

The target stays frozen; the head (`mtp.*`, Qwen3.5's names) is trained on the same kind of chats
(kvstate.recall.train_mtp), seeded, on one CPU thread, and written into the checkpoint (by default
the shipped kvstate-phonebook-hybrid, in place). Then a table: acceptance, tokens per verify step
and batch-1 decode tokens/s with and without the head on phone-book answers and copy chats
(kvstate.recall.mtp_eval), greedy replies checked token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from kvstate.terminal.arg_types import count_arg, seed_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="kvstate-phonebook-hybrid", metavar="PATH",
                        help="the target checkpoint or shipped model name (default: kvstate-phonebook-hybrid)")
    parser.add_argument("--out", metavar="DIR", default=None, help="write the model with its head here "
                        "(default: over the target checkpoint)")
    parser.add_argument("--steps", type=count_arg, default=None, help="optimiser steps (default: 3200)")
    parser.add_argument("--chunk-steps", type=count_arg, default=None, metavar="N",
                        help="run at most N steps, keep the training state in the output directory and stop; "
                        "the same command again continues (to the same head as one run)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of weights and data (default: 0)")
    parser.add_argument("--eval-only", action="store_true", help="measure the head the checkpoint has")
    parser.add_argument("--k", type=count_arg, default=1, help="drafts per step in the measurement (default: 1)")
    parser.add_argument("--json", action="store_true", help="print the measurement as JSON")


def run(args: argparse.Namespace) -> int:
    from kvstate.hub import resolve_checkpoint
    from kvstate.recall.mtp_eval import measure
    from kvstate.recall.train_mtp import MtpSettings, train_mtp
    from kvstate.terminal.console import make_console

    console = make_console(stderr=args.json)
    src = resolve_checkpoint(args.model)
    out = Path(args.out) if args.out else src
    if not args.eval_only:
        settings = MtpSettings() if args.steps is None else replace(MtpSettings(), steps=args.steps)
        with console.status("training the MTP head") as status:
            done = train_mtp(src, out, settings, seed=args.seed, chunk=args.chunk_steps,
                             log=lambda i, loss, acc: status.update(f"training the MTP head: step {i}, "
                                                                    f"loss {loss:.3f}, acc {acc:.2f}"))
        if not done["done"]:
            console.print(f"trained {done['steps']} of {settings.steps} steps; the same command continues")
            return 0
    with console.status("measuring"):
        rows = measure(str(out), k=args.k)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from rich.table import Table

    table = Table(title=f"MTP head of {out.name}: batch 1, greedy, k = {args.k}")
    for col in ("chats", "acceptance", "tokens/step", "plain tok/s", "MTP tok/s", "vs plain", "exact"):
        table.add_column(col, justify="left" if col == "chats" else "right")
    for r in rows:
        table.add_row(f"{r['kind']} ({r['chats']})", f"{100 * r['acceptance']:.0f}%", f"{r['tokens_per_step']:.2f}",
                      f"{r['plain_tokens_per_s']:.0f}", f"{r['mtp_tokens_per_s']:.0f}", f"{r['speedup']:.2f}x",
                      "yes" if r["exact"] else "NO")
    console.print(table)
    return 0
