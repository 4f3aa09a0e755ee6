"""The engine over TP ranks: rank 0 schedules and samples, every rank runs its shard of each step.

Rank 0 holds the EngineCore (torch-free scheduler, sampling) with a `TPRunner`: before each
step it broadcasts the step's plain data (the slot and block copies, `Batch.build`'s host lists,
the token ids, the sampled rows; after speculative verification the kept lengths) and then runs
its own shard; the workers (`worker_loop`) receive the same data and run theirs, so the
collectives inside the forward meet. The logits come back whole on rank 0 (vocab all-gather).

`spawn_workers` starts ranks 1..N-1 as torch.multiprocessing "spawn" processes joined through
gloo on a free 127.0.0.1 port (a spawned process imports the user's script again: one that starts
TP at its top level, without `if __name__ == "__main__":`, would start ranks from every rank, so
such a rank exits at once with MAIN_GUARD_EXIT and rank 0 stops with one line naming the fix);
under torchrun (`from_torchrun`) the launcher started them. A
worker whose rank 0 is gone exits (a watchdog on the parent pid); rank 0 checks its workers
before every step and a collective that loses a peer raises `RankFailure`, so a dead rank stops
the others with one clear error, never a hang.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from kvstate.engine.runner import ModelRunner, batch_layout
from kvstate.models.batch import BatchLayout
from kvstate.parallel.comm import DEFAULT_TIMEOUT, RankFailure, TPGroup, free_port


@dataclass
class StepData:
    """What a worker needs of a SchedulerOutput (plain lists)."""

    layout: BatchLayout | None  # the model's host lists, None for a step without a forward
    ids: list[int] = field(default_factory=list)
    slot_copies: list = field(default_factory=list)
    block_copies: list = field(default_factory=list)


@dataclass
class KeepData:
    kept: dict


class TPRunner(ModelRunner):
    """Rank 0's runner: the plain step data goes to the workers, then rank 0 runs its shard too."""

    scores_prompts = False  # the LM head gathers the vocabulary from every rank: no extra rows on rank 0 alone

    def __init__(self, model, plan, *, group: TPGroup, workers=(), **kwargs):
        super().__init__(model, model.plan, **kwargs)  # the rank's plan: pools of its heads only
        self.group, self.workers, self.closed = group, list(workers), False
        self.threads = torch.get_num_threads()
        self._send(dict(kwargs))  # the workers size their pools as rank 0 does

    def _send(self, msg) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            if proc.exitcode is not None:
                raise RankFailure(f"TP rank {rank} exited (exit code {proc.exitcode}); the engine stops")
        self.group.broadcast_object(msg)

    def execute(self, step):
        if not step.is_empty or step.slot_copies or step.block_copies:
            self._send(StepData(None if step.is_empty else batch_layout(step),
                                [] if step.is_empty else step.input_ids(),
                                list(step.slot_copies), list(step.block_copies)))
        return super().execute(step)

    def keep(self, kept: dict[int, int]) -> None:
        if self.rollback is not None:
            self._send(KeepData(dict(kept)))
        super().keep(kept)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (they leave their loop) and wait for their processes; once."""
        if self.closed:
            return
        self.closed = True
        try:
            self._send(None)
        except RankFailure:
            pass
        deadline = time.monotonic() + timeout
        for proc in self.workers:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
        self.workers = []


def worker_loop(group: TPGroup, model) -> ModelRunner:
    """A worker rank: build the pools from rank 0's sizes, then run every step it broadcasts until None;
    returns its runner (its pools, for tests)."""
    kwargs = group.broadcast_object()
    runner = ModelRunner(model, model.plan, **kwargs)
    while (msg := group.broadcast_object()) is not None:
        if isinstance(msg, KeepData):
            runner.keep(msg.kept)
            continue
        runner.copy_slots(msg.slot_copies)
        runner.copy_blocks(msg.block_copies)
        if msg.layout is not None:
            runner.run(msg.layout, msg.ids)
    return runner


def _watch_parent(parent: int) -> None:
    """Exit this worker when its parent (rank 0's process) is gone."""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(3)


def worker_main(rank: int, size: int, port: int, path: str, weight_dtype, threads: int, timeout: float,
                parent: int) -> None:
    """The body of a spawned worker process."""
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    from kvstate.parallel.model import load_shard

    group = TPGroup(rank, size, port, timeout=timeout)
    model, _ = load_shard(path, group, weight_dtype=weight_dtype)
    try:
        worker_loop(group, model)
    except RankFailure:
        os._exit(4)  # rank 0 went away mid-step: nothing left to serve


MAIN_GUARD_EXIT = 86  # a spawned rank that found itself re-running the user's script's top level
MAIN_GUARD_MESSAGE = ("kvstate: tensor parallelism starts its ranks as new processes that import your script "
                      "again; put the code that creates LLM(..., tensor_parallel_size=N) under "
                      "`if __name__ == \"__main__\":`")


def spawn_workers(size: int, path, weight_dtype=None, *, threads: int | None = None,
                  timeout: float = DEFAULT_TIMEOUT) -> tuple[TPGroup, list]:
    """Start ranks 1..size-1 (spawned processes) and join them as rank 0 -> (group, processes).
    Run from an unguarded script's top level it stops the program with MAIN_GUARD_MESSAGE
    (SystemExit: one line, no traceback), as the spawned ranks cannot start."""
    import multiprocessing
    import torch.multiprocessing as mp

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_EXIT)  # we are a rank being started, importing the script: quietly out

    threads = threads or max(1, torch.get_num_threads() // size)
    torch.set_num_threads(threads)
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker_main, daemon=True, name=f"kvstate-tp-rank{rank}",
                         args=(rank, size, port, str(path), weight_dtype, threads, timeout, os.getpid()))
             for rank in range(1, size)]
    for p in procs:
        p.start()
    def check() -> None:
        for rank, proc in enumerate(procs, start=1):
            if proc.exitcode == MAIN_GUARD_EXIT:
                raise _Unguarded
            if proc.exitcode is not None:
                raise RankFailure(f"TP rank {rank} exited while starting (exit code {proc.exitcode})")

    try:
        group = TPGroup(0, size, port, timeout=timeout, check=check)
    except (RankFailure, _Unguarded) as exc:
        for p in procs:
            p.terminate()
        if isinstance(exc, _Unguarded):
            print(MAIN_GUARD_MESSAGE, file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        raise
    return group, procs


class _Unguarded(Exception):
    """A spawned rank exited with MAIN_GUARD_EXIT (internal to spawn_workers)."""


def from_torchrun(size: int) -> bool:
    """Whether this process was started by torchrun for `size` ranks (RANK / WORLD_SIZE set)."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "0")) == size


def start(path, size: int, *, weight_dtype=None, timeout: float = DEFAULT_TIMEOUT):
    """Rank 0 of `size` TP ranks over the checkpoint at `path`: -> (its model, full plan, runner class).

    Spawns the workers (or, under torchrun, joins the others; a torchrun rank other than 0 serves
    the steps here and then leaves the program: SystemExit). What does not divide by `size` is
    one KvstateError before any process starts, as are int8 weights."""
    from functools import partial

    from kvstate.families import read_plan
    from kvstate.parallel.model import check_weight_dtype, load_shard
    from kvstate.parallel.plan import shard_plan

    shard_plan(read_plan(path), size)  # raises, naming what does not divide
    check_weight_dtype(weight_dtype)
    if from_torchrun(size):
        group, procs = TPGroup.from_env(timeout), []
        if group.rank != 0:
            model, _ = load_shard(path, group, weight_dtype=weight_dtype)
            worker_loop(group, model)
            raise SystemExit(0)
    else:
        group, procs = spawn_workers(size, path, weight_dtype, timeout=timeout)
    model, plan = load_shard(path, group, weight_dtype=weight_dtype)
    return model, plan, partial(TPRunner, group=group, workers=procs)
