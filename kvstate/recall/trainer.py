"""Train a tiny recall model on a fixed train set; exact accuracy on a held-out set; resumable.

The recipe measured on this machine: loss only at the answer positions, AdamW (lr 2e-3..3e-3,
weight decay 0.1 on matrices), linear warmup then cosine decay, batch 64-128, several epochs
over one fixed generated train set (curves plateau, then jump). The epoch order is drawn from
(seed, epoch), so a run resumed from a checkpoint takes exactly the steps an uninterrupted run
takes and ends with the same weights.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from kvstate.errors import KvstateError
from kvstate.recall.data import make_sets
from kvstate.recall.model import RecallModel
from kvstate.recall.tasks import IGNORE, TokenTask, accuracy_by_rank, mqar_write_ranks

FILLS = ("random", "zero")  # MQAR's non-query positions
CHECKPOINT_EVERY = 50  # steps between checkpoints (and at every epoch's end)


@dataclass(frozen=True)
class TrainConfig:
    task: str = "mqar"
    layers: str = "AA"
    width: int = 64
    heads: int = 1
    key_dim: int | None = None  # per head, fixed-state mixers; default width / heads
    pairs: int = 4  # MQAR pairs / phonebook entries
    seq_len: int = 64  # MQAR only
    vocab: int = 256  # MQAR only (small: a 8192-token vocabulary learns ~10x slower here)
    fill: str = "random"  # MQAR only: non-query positions random tokens, or "zero" (Zoology's published runs)
    conv: bool = True
    train_examples: int = 20000
    eval_examples: int = 1000
    epochs: int = 4
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    seed: int = 0

    @property
    def name(self) -> str:
        kd = f"-k{self.key_dim}" if self.key_dim else ""
        lr = "" if self.lr == TrainConfig.lr else f"-lr{self.lr:g}"
        fill = "-zerofill" if self.fill == "zero" else ""
        return f"{self.task}-{self.layers}-w{self.width}{kd}-p{self.pairs}{lr}{fill}" + ("" if self.conv else "-noconv")

    def check(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.train_examples < self.batch_size or self.eval_examples < 1:
            raise KvstateError("epochs >= 1, batch size >= 1, train examples >= batch size, eval examples >= 1")
        if not 0 < self.lr < 1 or not 0 <= self.weight_decay < float("inf"):  # (NaN fails both)
            raise KvstateError(f"lr must be in (0, 1) and weight decay >= 0 and finite, got {self.lr}, "
                               f"{self.weight_decay}")
        if self.fill not in FILLS:
            raise KvstateError(f"fill: one of {', '.join(FILLS)}, got {self.fill!r}")


def _rows(targets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat scored positions [R] of a [B, T] target batch and their targets [R]."""
    flat = torch.from_numpy(targets).reshape(-1)
    rows = (flat != IGNORE).nonzero().squeeze(1)
    return rows, flat.index_select(0, rows)


@torch.no_grad()
def hits(model: RecallModel, task: TokenTask, batch_size: int = 128) -> np.ndarray:
    """[R] bool: is the argmax the target, at each scored position (row-major order)."""
    model.eval()
    out = []
    for i in range(0, len(task.inputs), batch_size):
        rows, want = _rows(task.targets[i : i + batch_size])
        logits = model(torch.from_numpy(task.inputs[i : i + batch_size]), rows)
        out.append((logits.argmax(-1) == want).numpy())
    model.train()
    return np.concatenate(out)


def evaluate(model: RecallModel, task: TokenTask, batch_size: int = 128) -> float:
    """Exact accuracy: the share of scored positions whose argmax is the target."""
    return float(hits(model, task, batch_size).mean())


def _optimizer(model: RecallModel, cfg: TrainConfig, total_steps: int):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    warmup = max(1, total_steps // 20)

    def factor(step: int) -> float:  # linear warmup, cosine to 10% of the peak
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def train(cfg: TrainConfig, *, checkpoint: str | None = None, resume: bool = False,
          progress: Callable[[dict], None] | None = None, stop_after: int | None = None) -> dict:
    """Train `cfg`; returns the result (config, accuracy per epoch, loss curve, state sizes, time).
    `checkpoint`: file saved every CHECKPOINT_EVERY steps; `resume` continues from it. `progress`
    gets {step, total, epoch, loss, acc} after each step. `stop_after`: stop after that many steps
    in total (an interrupted run, for tests)."""
    cfg.check()
    train_set, eval_set, vocab = make_sets(cfg)
    torch.manual_seed(cfg.seed)
    model = RecallModel(cfg.layers, vocab, cfg.width, heads=cfg.heads, key_dim=cfg.key_dim, conv=cfg.conv)
    steps_per_epoch = cfg.train_examples // cfg.batch_size
    total = steps_per_epoch * cfg.epochs
    opt, sched = _optimizer(model, cfg, total)
    state = {"step": 0, "curve": [], "eval": [], "seconds": 0.0}
    if resume:
        if not checkpoint:
            raise KvstateError("--resume needs --out DIR (the checkpoint lives there)")
        try:
            saved = torch.load(checkpoint, weights_only=False)
        except FileNotFoundError:
            raise KvstateError(f"nothing to resume: {checkpoint} does not exist") from None
        if {**asdict(TrainConfig()), **saved["config"]} != asdict(cfg):  # options added since: their defaults
            raise KvstateError(f"{checkpoint} was written by another configuration: {saved['config']}")
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = saved["state"]

    def save() -> None:
        if checkpoint:
            torch.save({"config": asdict(cfg), "model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "state": state}, checkpoint)

    start, running = time.perf_counter() - state["seconds"], None
    try:
        while state["step"] < total and (stop_after is None or state["step"] < stop_after):
            running = _step(cfg, model, opt, sched, train_set, state, steps_per_epoch, running)
            state["seconds"] = time.perf_counter() - start
            if state["step"] % steps_per_epoch == 0:
                state["eval"].append((state["step"], evaluate(model, eval_set)))
            if progress:
                progress({"step": state["step"], "total": total, "epoch": -(-state["step"] // steps_per_epoch),
                          "loss": running[0], "acc": running[1]})
            if state["step"] % CHECKPOINT_EVERY == 0 or state["step"] % steps_per_epoch == 0:
                save()
    finally:  # stopped, finished or interrupted (Ctrl-C): the checkpoint holds the last step taken
        save()
    return _result(cfg, model, state, total, eval_set)


def _step(cfg: TrainConfig, model: RecallModel, opt, sched, train_set: TokenTask, state: dict,
          steps_per_epoch: int, running: tuple[float, float] | None) -> tuple[float, float]:
    """One optimiser step on the next batch of the epoch's order; returns the running (loss, accuracy)."""
    epoch, i = divmod(state["step"], steps_per_epoch)
    order = np.random.default_rng([cfg.seed, epoch]).permutation(cfg.train_examples)
    pick = order[i * cfg.batch_size : (i + 1) * cfg.batch_size]
    rows, want = _rows(train_set.targets[pick])
    logits = model(torch.from_numpy(train_set.inputs[pick]), rows)  # [R, vocab]
    loss = F.cross_entropy(logits, want)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    state["step"] += 1
    acc = float((logits.argmax(-1) == want).float().mean())
    state["curve"].append((state["step"], round(loss.item(), 4), round(acc, 4)))
    if running is None:
        return loss.item(), acc
    return 0.95 * running[0] + 0.05 * loss.item(), 0.95 * running[1] + 0.05 * acc


def _result(cfg: TrainConfig, model: RecallModel, state: dict, total: int, eval_set: TokenTask) -> dict:
    seq = eval_set.inputs.shape[1]
    states = model.state_numbers()
    kv_bytes = 2 * cfg.width * seq * 4  # an attention layer's K and V for one sequence, fp32
    done = state["step"] == total
    right = hits(model, eval_set)  # [R]: the final weights (a finished run's last epoch eval saw the same)
    return {"name": cfg.name, "config": asdict(cfg), "steps": state["step"], "total_steps": total, "finished": done,
            "eval_accuracy": float(right.mean()),
            "eval_per_epoch": [{"step": s, "accuracy": a} for s, a in state["eval"]],
            "curve": state["curve"][:: max(1, len(state["curve"]) // 200)],
            "seq_len": seq, "params": sum(p.numel() for p in model.parameters()),
            "state_numbers_per_layer": states,
            "state_bytes_per_layer": max(states) * 4 if any(states) else None,  # fp32 state of one sequence
            "kv_bytes_per_layer": kv_bytes if "A" in cfg.layers else None,
            "train_seconds": round(state["seconds"], 1), "threads": torch.get_num_threads(),
            # MQAR: held-out accuracy per pair in write order (oldest first): which pairs the state gave up
            "eval_by_write_rank": (accuracy_by_rank(right, mqar_write_ranks(eval_set, cfg.pairs), cfg.pairs)
                                   if cfg.task == "mqar" else None)}
