"""Bodies of the spawned TP ranks of the tests (importable by module path, as spawn needs)."""

from __future__ import annotations

import json
import os

import torch


def serve(rank: int, size: int, port: int, paths: list[str], out: str) -> None:
    """A worker rank serving one engine per checkpoint in turn (one process group for all of them);
    writes its pools' bytes per checkpoint to out/rank{rank}.json."""
    torch.set_num_threads(1)
    from kvstate.parallel.comm import TPGroup
    from kvstate.parallel.engine import worker_loop
    from kvstate.parallel.model import load_shard

    group = TPGroup(rank, size, port, timeout=120)
    pools = {}
    for path in paths:
        model, _ = load_shard(path, group)
        pools[path] = worker_loop(group, model).pool_bytes
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(pools, f)


def join_and_die(rank: int, size: int, port: int) -> None:
    """A rank that joins the group and dies before the first collective (as if killed)."""
    from kvstate.parallel.comm import TPGroup

    TPGroup(rank, size, port, timeout=20)
    os._exit(9)
