"""torchrun also works: every rank runs the user's program, LLM(tensor_parallel_size=N) joins torchrun's
ranks (its agent's store), rank 0 gets the single-process tokens and the workers exit cleanly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstate import LLM, SamplingParams
from kvstate.parallel.comm import free_port
from tests.parallel.checkpoints import save_tiny


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(save_tiny("jamba", tmp_path_factory.mktemp("tp") / "jamba"))


def test_torchrun_two_ranks(path):
    torchrun = Path(sys.executable).with_name("torchrun")
    script = Path(__file__).with_name("tp_script.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), str(script),
                           path, "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    alone = LLM(path, cache_memory="8MiB", max_num_seqs=2).generate(
        [[5, 9, 13, 27, 31], [40, 41, 42]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert got == [o.outputs[0].token_ids for o in alone]
