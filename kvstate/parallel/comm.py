"""The tensor-parallel process group: gloo over TCP on 127.0.0.1 (or torchrun's MASTER_ADDR/PORT).

`TPGroup` is a plain ProcessGroupGloo object, not torch.distributed's global default group, so
an `LLM(..., tensor_parallel_size=N)` leaves the caller's process state alone. Every collective
waits at most `timeout` seconds: a rank that died makes the others raise `RankFailure` (a
KvstateError naming the operation), never hang. Objects (the step data) travel pickled in a
uint8 tensor: its length first, then the bytes, over a second group whose timeout is long: a
worker waits for rank 0's next step as long as the engine idles (a dead peer still fails at once:
gloo sees its connection close).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from kvstate.errors import KvstateError

DEFAULT_TIMEOUT = 60.0  # seconds any collective may wait for the other ranks
JOIN_TIMEOUT = 600.0  # seconds the ranks may take to start (importing torch on a loaded machine is slow)
IDLE_TIMEOUT = 7 * 24 * 3600.0  # seconds a worker may wait for rank 0's next step (a server may idle)


class RankFailure(KvstateError):
    """Another rank stopped answering: it died, or raised and left the step."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPGroup:
    """Rank `rank` of `size` tensor-parallel ranks, joined through a TCPStore at host:port."""

    def __init__(self, rank: int, size: int, port: int, *, host: str = "127.0.0.1",
                 timeout: float = DEFAULT_TIMEOUT, hosts_store: bool | None = None, check=None):
        """`hosts_store`: whether this rank serves the TCPStore (default: rank 0; under torchrun its
        agent already serves one at MASTER_PORT and every rank is a client). `check()`, called every
        second while the ranks join, raises when a rank is known to have died (spawned workers)."""
        self.rank, self.size, self.timeout = rank, size, timeout
        # wall seconds this rank spent in the forward's collectives (waiting for the slowest rank included)
        self.seconds = {"all-reduce": 0.0, "all-gather": 0.0}
        wait = timedelta(seconds=timeout)
        try:
            master = rank == 0 if hosts_store is None else hosts_store
            join = timedelta(seconds=max(timeout, JOIN_TIMEOUT))
            self.store = dist.TCPStore(host, port, None, master, timeout=join, wait_for_workers=False)
            self.store.set(f"kvstate-tp/joined/{rank}", "1")  # then every rank is up: gloo connects at once
            self._join([f"kvstate-tp/joined/{r}" for r in range(size)], join.total_seconds(), check)
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("kvstate-tp/step", self.store), rank, size, wait)
            self.ctl = dist.ProcessGroupGloo(dist.PrefixStore("kvstate-tp/ctl", self.store), rank, size,
                                             timedelta(seconds=IDLE_TIMEOUT))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise RankFailure(f"TP rank {rank}: could not join the {size} ranks at {host}:{port} "
                              f"({str(exc).splitlines()[0][:160]})") from None

    def _join(self, keys: list[str], seconds: float, check) -> None:
        """Poll the store (no blocking wait: its timeouts log a warning a second) until every rank is up."""
        deadline = time.monotonic() + seconds
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{sum(self.store.check([k]) for k in keys)} of {len(keys)} ranks joined "
                                   f"within {seconds:g} s")
            if check is not None:
                check()
            time.sleep(0.05)

    @classmethod
    def from_env(cls, timeout: float = DEFAULT_TIMEOUT) -> "TPGroup":
        """The group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["MASTER_PORT"]),
                   host=os.environ.get("MASTER_ADDR", "127.0.0.1"), timeout=timeout,
                   hosts_store=False if agent else None)

    def _wait(self, issue, what: str) -> None:
        """Issue a collective (`issue()` -> its Work) and wait for it."""
        start = time.perf_counter()
        try:
            issue().wait()
        except RuntimeError as exc:
            raise RankFailure(f"TP rank {self.rank}: {what} failed: another rank stopped "
                              f"({str(exc).splitlines()[0][:160]})") from None
        if what in self.seconds:
            self.seconds[what] += time.perf_counter() - start

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (returns it)."""
        self._wait(lambda: self.pg.allreduce([t]), "all-reduce")
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on all), in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(lambda: self.pg.allgather([out], [t]), "all-gather")
        return out

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled)."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
            size = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self._wait(lambda: self.ctl.broadcast(size, 0), "broadcast")
        if self.rank != 0:
            data = torch.empty(int(size), dtype=torch.uint8)
        self._wait(lambda: self.ctl.broadcast(data, 0), "broadcast")
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1))
