"""Plots of recall runs (matplotlib, Agg): one run's training curve, and a sweep's accuracy against
the number of pairs and against the state bytes per layer (attention drawn at its KV bytes)."""

from __future__ import annotations

import os
from collections import defaultdict


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curve(result: dict, path: str) -> str:
    """Running train loss and batch accuracy against step, held-out accuracy at each epoch's end."""
    plt = _pyplot()
    steps, losses, accs = zip(*result["curve"]) if result["curve"] else ((), (), ())
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    left.plot(steps, losses, lw=1)
    left.set(xlabel="step", ylabel="train loss", title=result["name"])
    right.plot(steps, accs, lw=1, label="train batch")
    ev = result["eval_per_epoch"]
    right.plot([e["step"] for e in ev], [e["accuracy"] for e in ev], "o-", label="held-out")
    right.set(xlabel="step", ylabel="exact accuracy", ylim=(0, 1.02))
    right.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _log2_bytes(ax) -> None:
    """A base-2 log x axis labelled 256 B, 1 KiB, ... (matplotlib's minor labels overlap there)."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(
        lambda v, _: f"{v / 1024:g} KiB" if v >= 1024 else f"{v:g} B"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _plain_ticks(ax, values: list[int]) -> None:
    """Ticks at the swept values, written 4, 8, 16 (a log axis would write 4 x 10^0)."""
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    ax.xaxis.set_major_locator(FixedLocator(values))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _label(cfg: dict) -> str:
    return f"{cfg['layers']} w{cfg['width']}" + (f" k{cfg['key_dim']}" if cfg.get("key_dim") else "")


def _best_lr(results: list[dict]) -> list[dict]:
    """One result per model and task setting: the best over the learning rates swept (as Zoology reports)."""
    best = {}
    for r in results:
        key = tuple(sorted((k, v) for k, v in r["config"].items() if k != "lr"))
        if key not in best or r["eval_accuracy"] > best[key]["eval_accuracy"]:
            best[key] = r
    return list(best.values())


def plot_sweep(results: list[dict], out_dir: str) -> list[str]:
    """accuracy_vs_pairs.png (one line per model) and accuracy_vs_state.png (one line per layer
    pattern and pair count) in `out_dir`, each point the best learning rate where several were swept;
    returns the paths written."""
    plt = _pyplot()
    paths = []
    results = _best_lr(results)
    by_model = defaultdict(list)
    for r in results:
        by_model[_label(r["config"])].append((r["config"]["pairs"], r["eval_accuracy"]))
    if any(len(v) > 1 for v in by_model.values()):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for label, pts in sorted(by_model.items()):
            pts.sort()
            ax.plot([p for p, _ in pts], [a for _, a in pts], "o-", label=label)
        phonebook = all(r["config"].get("task") == "phonebook" for r in results)
        ax.set(xlabel="phonebook entries" if phonebook else "key-value pairs", ylabel="exact accuracy",
               ylim=(0, 1.02), xscale="log", title="recall vs " + ("entries" if phonebook else "pairs"))
        _plain_ticks(ax, sorted({r["config"]["pairs"] for r in results}))
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(os.path.join(out_dir, "accuracy_vs_pairs.png"))
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    by_kind = defaultdict(list)
    for r in results:
        size = r["state_bytes_per_layer"] or r["kv_bytes_per_layer"]
        by_kind[(r["config"]["layers"], r["config"]["pairs"])].append((size, r["eval_accuracy"]))
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for (layers, pairs), pts in sorted(by_kind.items()):
        pts.sort()
        style = "s--" if set(layers) == {"A"} else "o-"
        ax.plot([s for s, _ in pts], [a for _, a in pts], style, label=f"{layers}, {pairs} pairs")
    ax.set(xlabel="state bytes per layer (attention: KV bytes at the sequence length)", ylabel="exact accuracy",
           ylim=(0, 1.02), title="recall vs state size")
    _log2_bytes(ax)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "accuracy_vs_state.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def plot_capacity(rows, path: str) -> str:
    """`kvstate recall capacity`'s rows (CapacityRow): accuracy against pairs per key dim and mixer, and
    accuracy against write order at the largest pair count (the newest write on the right)."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    from kvstate.recall.capacity import mixer_label

    lines = defaultdict(list)
    for r in rows:
        lines[(r.key_dim, mixer_label(r))].append(r)
    many_dims = len({r.key_dim for r in rows}) > 1
    for (d, label), rs in lines.items():
        label += f", key dim {d}" if many_dims else ""
        style = {"linear attention": "s--", "gated linear attention": "^:"}.get(rs[0].mixer, "o-")
        left.plot([r.pairs for r in rs], [r.accuracy for r in rs], style, label=label)
        last = max(rs, key=lambda r: r.pairs)
        right.plot(range(1, last.pairs + 1), last.by_rank, style[1:], label=label)
    most = max(r.pairs for r in rows)
    left.set(xlabel="pairs written", ylabel="reads right", ylim=(0, 1.02), xscale="log",
             title="accuracy vs pairs" + ("" if many_dims else f" (key dim {rows[0].key_dim})"))
    _plain_ticks(left, sorted({r.pairs for r in rows}))
    right.set(xlabel="write order (1 = oldest)", ylabel="reads right", ylim=(0, 1.02),
              title=f"who gives way: {most} pairs")
    left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
