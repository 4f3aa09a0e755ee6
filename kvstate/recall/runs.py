"""What `kvstate recall train` and `sweep` do around the trainer: parse the options into configs,
draw the progress bar, write result.json / sweep.json and the plots, resume unfinished runs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from kvstate.terminal.number_list import number_list
from kvstate.errors import KvstateError
from kvstate.recall.trainer import TrainConfig

RESULT, CHECKPOINT = "result.json", "checkpoint.pt"


def _ints(text: str | None, what: str) -> list[int | None]:
    """Positive whole numbers; [None] when the option was not given (its default applies)."""
    return [None] if text is None else number_list(f"--{what}", text, int, 1)


def configs_from_args(args: argparse.Namespace) -> list[TrainConfig]:
    """The grid the options describe (one config for `train`), each checked."""
    patterns = [p.strip().upper() for p in args.layers.split(",") if p.strip()]
    if not patterns:
        raise KvstateError("--layers: at least one layer pattern, e.g. AA or GA")
    out = []
    grid = itertools.product(patterns, _ints(args.pairs, "pairs"), _ints(args.width, "width"),
                             _ints(args.key_dim, "key-dim"), number_list("--lr", args.lr, float))
    for layers, pairs, width, key_dim, lr in grid:
        if "A" in layers and set(layers) == {"A"}:
            key_dim = None  # attention has no fixed state to grow
        cfg = TrainConfig(task=args.task, layers=layers, width=width, heads=args.heads, key_dim=key_dim, pairs=pairs,
                          seq_len=args.seq_len, vocab=args.vocab, fill=args.fill, conv=not args.no_conv,
                          train_examples=args.train_examples, eval_examples=args.eval_examples, epochs=args.epochs,
                          batch_size=args.batch_size, lr=lr, weight_decay=args.weight_decay, seed=args.seed)
        _check(cfg)
        if cfg not in out:
            out.append(cfg)
    return out


def _check(cfg: TrainConfig) -> None:
    from kvstate.recall.model import RecallModel

    cfg.check()
    RecallModel(cfg.layers, 2, cfg.width, heads=cfg.heads, key_dim=cfg.key_dim, conv=cfg.conv)  # pattern, sizes
    if cfg.task == "mqar" and (cfg.seq_len % 2 or cfg.seq_len < 4 * cfg.pairs or cfg.vocab <= cfg.seq_len
                               or cfg.pairs >= cfg.vocab // 2):
        raise KvstateError(f"mqar: seq len must be even and >= 4 x pairs, vocab > seq len and > 2 x pairs "
                           f"(got seq len {cfg.seq_len}, {cfg.pairs} pairs, vocab {cfg.vocab})")
    if cfg.task == "phonebook" and not 1 <= cfg.pairs <= 520:
        raise KvstateError(f"phonebook: 1 to 520 entries, got {cfg.pairs}")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    configs = configs_from_args(args)
    if len(configs) != 1:
        raise KvstateError("train takes one value per option; use `kvstate recall sweep` for a grid")
    return configs[0]


def _set_threads(threads: int | None) -> None:
    import torch

    # one thread by default: on a shared 2-core machine a second thread mostly spins (5x slower measured)
    torch.set_num_threads(threads or 1)


def train_and_report(cfg: TrainConfig, *, out: str | None, resume: bool, quiet: bool, threads: int | None = None,
                     label: str = "", table: bool = True) -> dict:
    """One run with a progress bar (unless quiet); result.json, checkpoint.pt and curve.png in `out`."""
    from kvstate.terminal.console import make_console
    from kvstate.recall.trainer import train

    _set_threads(threads)
    if resume and not out:
        raise KvstateError("--resume needs --out DIR (the checkpoint lives there)")
    checkpoint = None
    if out:
        os.makedirs(out, exist_ok=True)
        checkpoint = os.path.join(out, CHECKPOINT)
    console = make_console(stderr=True)
    if quiet or not console.is_terminal:
        result = train(cfg, checkpoint=checkpoint, resume=resume)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn(f"{label}{cfg.name}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("epoch {task.fields[epoch]} loss {task.fields[loss]:.3f} acc {task.fields[acc]:.1%}"),
                      TimeRemainingColumn(), console=console, transient=True) as bar:
            task = bar.add_task("train", total=None, epoch=0, loss=float("nan"), acc=0.0)

            def update(p: dict) -> None:
                bar.update(task, completed=p["step"], total=p["total"], epoch=p["epoch"], loss=p["loss"], acc=p["acc"])

            result = train(cfg, checkpoint=checkpoint, resume=resume, progress=update)
    if out:
        with open(os.path.join(out, RESULT), "w") as f:
            json.dump(result, f, indent=1)
        from kvstate.recall.plots import plot_curve

        plot_curve(result, os.path.join(out, "curve.png"))
    if table and not quiet:
        _summary(make_console(), [result])
    return result


def _summary(console, results: list[dict]) -> None:
    from rich.table import Table

    table = Table("run", "layers", "pairs", "state B/layer", "KV B/layer", "steps", "accuracy", "oldest 1/4",
                  "newest 1/4", "seconds")
    for r in results:
        c = r["config"]
        table.add_row(r["name"], c["layers"], str(c["pairs"]), f"{r['state_bytes_per_layer'] or '-'}",
                      f"{r['kv_bytes_per_layer'] or '-'}", f"{r['steps']}/{r['total_steps']}",
                      f"{r['eval_accuracy']:.1%}", *_quarters(r.get("eval_by_write_rank")), f"{r['train_seconds']:.0f}")
    console.print(table)


def _quarters(by_rank: list | None) -> tuple[str, str]:
    """Held-out accuracy over the oldest and the newest quarter of the pairs (MQAR), '-' elsewhere."""
    known = [a for a in by_rank or () if a is not None]
    if not known:
        return "-", "-"
    q = max(1, len(known) // 4)
    return f"{sum(known[:q]) / q:.1%}", f"{sum(known[-q:]) / q:.1%}"


def sweep(args: argparse.Namespace) -> list[dict]:
    """Every config of the grid, one after another, in DIR/<name>/; sweep.json and two plots in DIR."""
    from kvstate.terminal.console import make_console
    from kvstate.recall.plots import plot_sweep

    configs = configs_from_args(args)
    results = []
    for i, cfg in enumerate(configs):
        run_dir = os.path.join(args.out, cfg.name)
        done = os.path.join(run_dir, RESULT)
        if args.resume and os.path.exists(done):
            with open(done) as f:
                result = json.load(f)
            if result.get("finished") and TrainConfig(**result["config"]) == cfg:
                results.append(result)
                continue
        resume = args.resume and os.path.exists(os.path.join(run_dir, CHECKPOINT))
        results.append(train_and_report(cfg, out=run_dir, resume=resume, quiet=args.json, threads=args.threads,
                                        label=f"[{i + 1}/{len(configs)}] ", table=False))
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "curve"} for r in results], f, indent=1)
    plot_sweep(results, args.out)
    if not args.json:
        _summary(make_console(), results)
    return results
