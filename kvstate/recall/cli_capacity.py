"""`kvstate recall capacity`: write N random key-value pairs into one head's state with linear
attention (plain and gated by a decay) and with the delta rule, read every key back, and print who
gives way (no training).

For each key dim and pair count: the fraction of reads nearer their own value than any other
written value, over all writes and over the newest and oldest quarter, and the mean cosine of a
read with its value. `--plot FILE` draws accuracy against pairs and, at the largest pair count,
accuracy against write order; `--json` prints the rows.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvstate.terminal.arg_types import count_arg, seed_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--key-dim", default="16", metavar="K,K,...",
                        help="key (= value) dims of the state (default: 16)")
    parser.add_argument("--pairs", default="4,8,16,32,64", metavar="N,N,...",
                        help="pairs written (default: 4,8,16,32,64)")
    parser.add_argument("--beta", default="1,0.5,0.25", metavar="B,B,...",
                        help="the delta rule's write strengths, in (0, 1] (default: 1,0.5,0.25)")
    parser.add_argument("--decay", default="0.9", metavar="A,A,...",
                        help="gated linear attention's decays per write, in (0, 1]; '' for none (default: 0.9)")
    parser.add_argument("--trials", type=count_arg, default=256, help="random sets of pairs per setting (default: 256)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the keys and values (default: 0)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="write the plot (.png or .svg)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args: argparse.Namespace) -> int:
    from kvstate.terminal.number_list import number_list
    from kvstate.terminal.plot_path import check_plot_path
    from kvstate.errors import KvstateError

    key_dims = number_list("--key-dim", args.key_dim, int, 1, 512)
    pairs = number_list("--pairs", args.pairs, int, 1, 4096)
    betas = number_list("--beta", args.beta, float, 1e-6, 1.0)
    decays = number_list("--decay", args.decay, float, 1e-6, 1.0) if args.decay.strip() else []
    if args.trials > 100_000:  # (counts below 1 are refused when parsed)
        raise KvstateError(f"--trials: from 1 to 100000, got {args.trials}")
    if args.plot:
        check_plot_path(args.plot)
    import torch

    from kvstate.recall.capacity import capacity_rows

    torch.set_num_threads(1)  # small ops: one thread is faster here, and leaves the other core alone
    rows = capacity_rows(key_dims, pairs, betas, decays=decays, trials=args.trials, seed=args.seed)
    if args.plot:
        from kvstate.recall.plots import plot_capacity

        plot_capacity(rows, args.plot)
    if args.json:
        json.dump([r.as_dict() for r in rows], sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print_table(rows, args)
    return 0


def _print_table(rows, args) -> None:
    from rich.table import Table

    from kvstate.terminal.console import make_console
    from kvstate.recall.capacity import mixer_label

    table = Table(title="what one head's state holds: write N pairs, read every key back")
    for name in ("key dim", "pairs", "mixer", "accuracy", "newest 1/4", "oldest 1/4", "cosine"):
        table.add_column(name, justify="left" if name == "mixer" else "right")
    for r in rows:
        table.add_row(str(r.key_dim), str(r.pairs), mixer_label(r), f"{r.accuracy:.1%}", f"{r.newest:.1%}",
                      f"{r.oldest:.1%}", f"{r.cosine:.3f}")
    console = make_console()
    console.print(table)
    console.print(f"{args.trials} random sets of unit keys and values per row (seed {args.seed}); a read is right when "
                  "it is nearer its own value than any other value written.")
    if args.plot:
        console.print(f"plot: {args.plot}")
