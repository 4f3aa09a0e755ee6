"""`kvstate recall sweep`: train a grid (layer patterns x pairs x widths x key dims), one run at a
time, and plot accuracy against the number of pairs and against state bytes per layer.

Every run is an ordinary `train` run in `DIR/<name>/` (so an interrupted sweep resumes: finished
runs are read back, the unfinished one continues from its checkpoint with `--resume`).
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstate.recall.cli_train import add_model_args


def configure(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser, sweep=True)
    parser.add_argument("--out", metavar="DIR", required=True, help="one folder per run, sweep.json and the plots")
    parser.add_argument("--resume", action="store_true", help="reuse finished runs and resume the unfinished one")


def run(args: argparse.Namespace) -> int:
    from kvstate.recall.runs import sweep

    results = sweep(args)
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
