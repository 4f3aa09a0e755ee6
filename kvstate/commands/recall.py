"""`kvstate recall <sub>`: train tiny recall models on CPU, sweep them, run the phonebook test.

Each subcommand lives in its own module with `configure(parser)` and `run(args)` (the same
contract as `kvstate.cli.COMMANDS`), imported only when the parser is built, so adding one is a
single line in `SUBCOMMANDS`. Nothing heavy (torch, matplotlib) is imported at module level.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module with configure/run, one-line help). Add a subcommand here, in one line.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("kvstate.recall.cli_train", "train one tiny two-layer model on MQAR or phonebook (CPU, resumable)"),
    "sweep": ("kvstate.recall.cli_sweep", "train a grid of mixers x pairs x state sizes; JSON results and plots"),
    "phonebook": ("kvstate.recall.cli_phonebook",
                  "exact phonebook recall vs book size through the engine, with KV and state bytes"),
    "capacity": ("kvstate.recall.cli_capacity",
                 "write N random pairs into one head's state (linear attention, gated, delta rule) and read them back"),
    "train-default": ("kvstate.recall.cli_train_default",
                      "train the two shipped models (kvstate-phonebook-hybrid, -linear)"),
    "train-mtp": ("kvstate.recall.cli_train_mtp",
                  "train a shipped model's MTP head (speculative drafts), measure acceptance and speed"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="recall_command", metavar="<recall-subcommand>")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.configure(p)
        p.set_defaults(_recall_run=module.run)
    parser.set_defaults(_recall_parser=parser)


def run(args: argparse.Namespace) -> int:
    runner = getattr(args, "_recall_run", None)
    if runner is None:
        args._recall_parser.print_help()
        return 0
    return int(runner(args) or 0)
