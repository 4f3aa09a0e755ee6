"""`kvstate recall train`: train one tiny model on MQAR or the phonebook task, on CPU.

A layer pattern picks the mixers (one letter per layer, `kvstate.recall.mixers.KINDS`): `AA`
two attention layers, `LL` linear attention, `GA` a Gated DeltaNet + attention hybrid, `GGGA` a
3:1 stack. A rich progress bar shows the running loss and accuracy; `--out DIR` keeps a
checkpoint (resumed with `--resume`) and `result.json`; `--json` prints the result.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstate.terminal.arg_types import count_arg, seed_arg


def add_model_args(parser: argparse.ArgumentParser, *, sweep: bool = False) -> None:
    """The model, task and optimiser options `train` and `sweep` share (sweep takes lists of some)."""
    many = " (comma-separated list)" if sweep else ""
    parser.add_argument("--task", choices=("mqar", "phonebook"), default="mqar", help="task (default: mqar)")
    parser.add_argument("--layers", default="AA" if not sweep else "AA,LL,DD,GG",
                        help="layer pattern, one letter per layer: A attention, L linear attention, D DeltaNet, "
                             "G Gated DeltaNet, K KDA, M Mamba-2" + many)
    parser.add_argument("--width", default="64", help="model width (32-128)" + many)
    parser.add_argument("--heads", type=count_arg, default=1, help="heads of every mixer (default: 1)")
    parser.add_argument("--key-dim", default=None,
                        help="key dim per head of the fixed-state mixers (default: width / heads)" + many)
    parser.add_argument("--pairs", default="4", help="MQAR key-value pairs / phonebook entries" + many)
    parser.add_argument("--seq-len", type=count_arg, default=64, help="MQAR sequence length (default: 64)")
    parser.add_argument("--vocab", type=count_arg, default=256,
                        help="MQAR vocabulary, > seq len (default: 256; Zoology uses 8192, which learns far "
                             "slower on CPU)")
    parser.add_argument("--fill", choices=("random", "zero"), default="random",
                        help="MQAR's non-query positions: random tokens (Zoology's generator default) or 0 (its "
                             "published configs; no spurious pairs for a recurrent state to write); default: random")
    parser.add_argument("--no-conv", action="store_true", help="no short conv before the mixers (to show the stall)")
    parser.add_argument("--train-examples", type=count_arg, default=20000, help="fixed train set size (default: 20000)")
    parser.add_argument("--eval-examples", type=count_arg, default=1000, help="held-out set size (default: 1000)")
    parser.add_argument("--epochs", type=count_arg, default=4, help="epochs over the train set (default: 4)")
    parser.add_argument("--batch-size", type=count_arg, default=64, help="batch size (default: 64)")
    parser.add_argument("--lr", default="3e-3", help="AdamW peak learning rate (default: 3e-3)" + many)
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default: 0.1)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of data and weights (default: 0)")
    parser.add_argument("--threads", type=count_arg, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    parser.add_argument("--out", metavar="DIR", help="write checkpoint.pt, result.json and curve.png here")
    parser.add_argument("--resume", action="store_true", help="continue from DIR/checkpoint.pt (needs --out)")


def run(args: argparse.Namespace) -> int:
    from kvstate.recall.runs import config_from_args, train_and_report

    config = config_from_args(args)
    result = train_and_report(config, out=args.out, resume=args.resume, quiet=args.json, threads=args.threads)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
