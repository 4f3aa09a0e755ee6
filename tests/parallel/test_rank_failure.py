"""LLM(tensor_parallel_size=2) runs exactly as one process; a rank that dies stops the others with
one clear error within a timeout, never a hang."""

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from kvstate.llm import LLM
from kvstate.errors import KvstateError
from kvstate.parallel.comm import RankFailure, TPGroup, free_port
from tests.parallel.checkpoints import save_tiny
from tests.parallel.workers import join_and_die

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 9, 13, 27, 31], [40, 41, 42]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(save_tiny("qwen3_5", tmp_path_factory.mktemp("tp") / "qwen3_5"))


def test_llm_spawns_its_ranks_and_a_killed_rank_stops_it(path):
    torch.set_num_threads(1)
    alone = [o.outputs[0].token_ids for o in LLM(path, cache_memory="8MiB", max_num_seqs=2).generate(PROMPTS, GREEDY)]
    llm = LLM(path, cache_memory="8MiB", max_num_seqs=2, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone
        worker = llm.runner.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(KvstateError, match="TP rank 1 exited"):
            llm.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 30
    finally:
        llm.close()


def test_a_rank_dying_before_a_collective_fails_it_within_the_timeout():
    port = free_port()
    proc = mp.get_context("spawn").Process(target=join_and_die, args=(1, 2, port), daemon=True)
    proc.start()
    group = TPGroup(0, 2, port, timeout=20)
    proc.join(30)
    start = time.monotonic()
    with pytest.raises(RankFailure, match="all-reduce failed: another rank stopped"):
        group.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 25


def test_what_does_not_divide_fails_before_any_process_starts(path):
    with pytest.raises(KvstateError, match="does not divide by --tp 3"):
        LLM(path, tensor_parallel_size=3)


def _gone(pid: int) -> bool:
    """The process has exited (a zombie left to a non-reaping init counts as gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_workers_exit_when_rank_0_is_killed(path):
    import subprocess
    import sys

    code = ("import sys, time, torch; torch.set_num_threads(1); from kvstate import LLM; "
            f"llm = LLM({path!r}, cache_memory='8MiB', tensor_parallel_size=2); "
            "print(llm.runner.workers[0].pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        assert not _gone(worker)
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 20
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(worker), "a worker outlived its rank 0 by 20 s"
