"""2 and 4 gloo ranks on CPU give exactly the single-process greedy tokens through the engine.

Every family's tiny checkpoint (GDN, GDN + MoE, KDA + MLA + MoE, Mamba-2 + attention + MoE,
Mamba-2, Mamba-1 + attention + MoE, dense) runs a workload with chunked prefill (8 tokens a step)
and, where the model has KV layers, preemption (a cache of a few blocks), with the workers spawned
once and the process group shared by all checkpoints. Each rank's pools hold exactly the bytes of
its rank plan's cache spec, and rank 0's are `kvstate memory --tp N`'s per-device figures.
"""

import json
from functools import partial

import pytest
import torch
import torch.multiprocessing as mp

from kvstate.cache.spec import cache_spec
from kvstate.cli import main
from kvstate.families import read_plan
from kvstate.engine.config import EngineConfig
from kvstate.engine.core import EngineCore
from kvstate.llm import LLM
from kvstate.engine.params import SamplingParams
from kvstate.parallel.comm import TPGroup, free_port
from kvstate.parallel.engine import TPRunner
from kvstate.parallel.model import load_shard
from kvstate.parallel.plan import shard_plan
from tests.arrivals import run_arrivals
from tests.parallel.checkpoints import FAMILIES, VOCAB, save_tiny
from tests.parallel.workers import serve

NEW, BLOCK, SEQS = 10, 4, 3
LENGTHS = [13, 5, 9, 17]


def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def budget(plan, tp: int, blocks: int) -> int:
    """A per-rank cache of `SEQS` state slots and `blocks` KV blocks of the rank's plan."""
    spec = cache_spec(shard_plan(plan, tp), kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    return SEQS * spec.state_bytes + blocks * BLOCK * spec.kv_bytes_per_token


def run_workload(core) -> tuple[dict, int]:
    """The prompts arriving one every other step -> ({i: tokens}, preemptions)."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    done, _ = run_arrivals(core, prompts(), greedy)
    return ({i: o.token_ids for i, o in done.items()},
            sum(o.metrics["num_preemptions"] for o in done.values()))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {f: str(save_tiny(f, root / f)) for f in FAMILIES}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """Single-process greedy tokens of every checkpoint (a roomy cache, no preemption)."""
    torch.set_num_threads(1)
    out = {}
    for fam, path in checkpoints.items():
        llm = LLM(path, cache_memory="64MiB", max_num_seqs=SEQS)
        out[fam] = run_workload(llm.engine)[0]
    return out


def run_tp(checkpoints, families, size, tmp_path) -> dict:
    """Rank 0 here, ranks 1..size-1 spawned once: every family's workload through the TP engine."""
    paths = [checkpoints[f] for f in families]
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=serve, args=(r, size, port, paths, str(tmp_path)), daemon=True)
             for r in range(1, size)]
    for p in procs:
        p.start()
    group = TPGroup(0, size, port, timeout=120)
    results = {}
    for fam, path in zip(families, paths):
        model, plan = load_shard(path, group)
        config = EngineConfig(cache_memory=budget(plan, size, 12), block_size=BLOCK, max_num_seqs=SEQS,
                              max_num_batched_tokens=8)
        core = EngineCore(model, plan, config=config, runner_class=partial(TPRunner, group=group))
        tokens, preempted = run_workload(core)
        results[fam] = dict(tokens=tokens, preempted=preempted, pools=core.runner.pool_bytes,
                            sizes=core.runner.sizes, kv=read_plan(path).layer_string)
        core.runner.close()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for r in range(1, size):
        worker = json.loads((tmp_path / f"rank{r}.json").read_text())
        for fam, path in zip(families, paths):
            results[fam][f"pools{r}"] = worker[path]
    return results


F32 = ["--kv-dtype", "float32", "--state-dtype", "float32", "--conv-dtype", "float32"]


def planner(path, size, capsys) -> dict:
    """`kvstate memory PATH --tp size --json` (fp32 caches, as the engine's pools)."""
    capsys.readouterr()
    assert main(["memory", path, "--tp", str(size), "--json", *F32]) == 0
    return json.loads(capsys.readouterr().out)[0]


def check(results, checkpoints, reference, size, capsys):
    for fam, got in results.items():
        assert got["tokens"] == reference[fam], fam
        plan = read_plan(checkpoints[fam])
        if "A" in got["kv"] or "L" in got["kv"]:
            assert got["preempted"] > 0, f"{fam}: the small cache should have forced a preemption"
        sizes = got["sizes"]
        for r in range(size):
            spec = cache_spec(shard_plan(plan, size, r), kv_dtype="float32", state_dtype="float32",
                              conv_dtype="float32")
            planned = {"kv": sizes.num_blocks * BLOCK * spec.kv_bytes_per_token,
                       "state": sizes.num_slots * spec.state_bytes}
            assert (got["pools"] if r == 0 else got[f"pools{r}"]) == planned, (fam, r)
        per_device = planner(checkpoints[fam], size, capsys)  # the planner's figures are rank 0's
        assert got["pools"] == {"kv": sizes.num_blocks * BLOCK * per_device["kv_bytes_per_token"],
                                "state": sizes.num_slots * per_device["state_bytes"]}, fam


def test_two_ranks_every_family(checkpoints, reference, tmp_path, capsys):
    torch.set_num_threads(1)
    check(run_tp(checkpoints, FAMILIES, 2, tmp_path), checkpoints, reference, 2, capsys)


def test_four_ranks_where_heads_divide(checkpoints, reference, tmp_path, capsys):
    """Qwen3.5 (KV heads 2 < 4: replicated), Nemotron-H and Falcon-H1 (Mamba-2 groups 2 < 4: a norm group
    spans ranks; Falcon-H1's norms before gating)."""
    torch.set_num_threads(1)
    fams = ["qwen3_5", "nemotron_h", "falcon_h1"]
    check(run_tp(checkpoints, fams, 4, tmp_path), checkpoints, reference, 4, capsys)
