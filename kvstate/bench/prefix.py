"""`kvstate bench prefix`: prefix caching on a multi-turn chat workload, three policies in one process.

8 conversations x 6 turns share one system prompt (token ids, seeded); each turn appends a user
message to the conversation so far and generates a greedy reply, one request at a time, so time
to first token is the prefill the policy leaves to compute. Policies, on the same checkpoint (a
random ~0.5B Qwen3.5-style one; `--quick`: small):

- off: every prompt prefilled whole;
- aligned: what vLLM does for hybrid models: state kept only at multiples of 1,024 tokens;
- kvstate: snapshots at prompt ends, reply ends, branch points and every 512 tokens.

Reported per policy: prompt tokens computed, the share of the ideally reusable prompt tokens reused
(ideal: each prompt's longest common prefix with any earlier conversation, one token left to
compute), mean time to first token of turn 1 and of turns 2-6, and ratios to "off". The replies of
all policies must be the same tokens (prefix caching is exact). Each prompt runs through the three
policies' engines back to back, so a load that drifts on a shared machine weighs on all of them alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

from kvstate.terminal.arg_types import seed_arg

POLICIES = {"off": {}, "aligned": {"enable_prefix_caching": True, "prefix_align": 1024, "snapshot_interval": 1024},
            "kvstate": {"enable_prefix_caching": True, "snapshot_interval": 512}}
SHAPES = {  # conversations, turns, system prompt, user message, reply tokens, alignment of "aligned"
    "full": dict(convs=8, turns=6, system=512, user=96, reply=16, align=1024),
    "quick": dict(convs=3, turns=3, system=40, user=12, reply=4, align=64),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model and short conversations (seconds)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the conversations' token ids")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def make_engine(path, policy: str, shape: dict):
    """The engine of one policy: room for every conversation's KV and three snapshots per conversation
    (eviction is not what is measured)."""
    from kvstate.cache.spec import cache_spec
    from kvstate.families import read_plan
    from kvstate.llm import LLM
    from kvstate.engine.params import SamplingParams

    options = dict(POLICIES[policy])
    if "prefix_align" in options:
        options["prefix_align"] = options["snapshot_interval"] = shape["align"]
    longest = shape["system"] + shape["turns"] * (shape["user"] + shape["reply"]) + 8
    spec = cache_spec(read_plan(path), kv_dtype="float32", state_dtype="float32", conv_dtype="float32")
    spare = 3 * shape["convs"]
    budget = (2 + spare) * spec.state_bytes + (shape["convs"] + 2) * longest * spec.kv_bytes_per_token
    if options:
        options["num_snapshot_slots"] = spare
    llm = LLM(path, cache_memory=budget, max_num_seqs=2, max_model_len=longest, max_num_batched_tokens=4096,
              **options)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))  # warm-up (ids < 10: shares nothing)
    return llm


def run_policies(path, shape: dict, seed: int, console) -> list[dict]:
    """Every prompt of the workload through every policy's engine, one right after the other (a load
    that drifts on a shared machine then weighs on all policies alike); rows per policy."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstate.engine.params import SamplingParams

    with console.status("loading one engine per policy"):
        engines = {p: make_engine(path, p, shape) for p in POLICIES}
    rng = random.Random(seed)
    system = [rng.randrange(10, engines["off"].plan.vocab_size) for _ in range(shape["system"])]
    params = SamplingParams(temperature=0, max_tokens=shape["reply"], ignore_eos=True)
    rows: dict[str, list] = {p: [] for p in POLICIES}
    bar = Progress(TextColumn("prompts, each through every policy"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    task = bar.add_task("prompts", total=shape["convs"] * shape["turns"])
    with bar:
        _workload(engines, shape, rng, system, params, rows, bar, task)
    del engines
    gc.collect()
    return [{"policy": p, "rows": r} for p, r in rows.items()]


def _workload(engines: dict, shape: dict, rng, system, params, rows: dict, bar, task) -> None:
    from kvstate.errors import KvstateError

    vocab = engines["off"].plan.vocab_size
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    chats = [list(system) for _ in range(shape["convs"])]
    history: list[list[int]] = []
    for turn in range(shape["turns"]):
        for c, chat in enumerate(chats):
            chat += ids(shape["user"])
            ideal = max([min(common_prefix(chat, h), len(chat) - 1) for h in history] or [0])
            replies = []
            for policy, llm in engines.items():
                out = llm.generate([list(chat)], params)[0]
                rows[policy].append(dict(turn=turn + 1, conv=c, prompt=len(chat), ideal=ideal,
                                         cached=out.num_cached_tokens or 0,
                                         ttft=out.metrics["time_to_first_token"], reply=out.token_ids))
                replies.append(out.token_ids)
            if any(r != replies[0] for r in replies):
                raise KvstateError("bench prefix: the policies' replies differ (prefix caching must be exact)")
            chat += replies[0]
            history.append(list(chat))
            bar.advance(task)


def summarize(result: dict) -> dict:
    rows = result["rows"]
    later = [r for r in rows if r["turn"] > 1]
    first = [r for r in rows if r["turn"] == 1]
    ideal = sum(r["ideal"] for r in rows)
    reused = sum(min(r["cached"], r["ideal"]) for r in rows)
    return {"policy": result["policy"], "prompt_tokens": sum(r["prompt"] for r in rows),
            "computed_tokens": sum(r["prompt"] - r["cached"] for r in rows),
            "cached_tokens": sum(r["cached"] for r in rows), "ideal_reusable": ideal,
            "reuse_of_ideal": reused / ideal if ideal else 0.0,
            "ttft_turn1_ms": 1000 * sum(r["ttft"] for r in first) / len(first),
            "ttft_later_ms": 1000 * sum(r["ttft"] for r in later) / max(1, len(later))}


def run(args: argparse.Namespace) -> int:
    import tempfile

    from rich.table import Table

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.bench.timing import start

    console, _ = start(args)
    shape = SHAPES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-prefix-") as tmp:
        with console.status("building checkpoint"):
            path, hf = qwen3_5_checkpoint("quick" if args.quick else "0.5b", tmp)
            del hf
        started = time.perf_counter()
        results = run_policies(path, shape, args.seed, console)
    table = [summarize(res) for res in results]
    off = table[0]
    for row in table:
        row["computed_vs_off"] = row["computed_tokens"] / off["computed_tokens"]
        row["ttft_later_speedup"] = off["ttft_later_ms"] / row["ttft_later_ms"]
    result = {"shape": shape, "policies": table, "replies_identical": True,
              "seconds": time.perf_counter() - started,
              "targets": {"reuse_of_ideal >= 0.9": table[-1]["reuse_of_ideal"] >= 0.9,
                          "ttft_later_speedup >= 4": table[-1]["ttft_later_speedup"] >= 4}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console.print(f"{shape['convs']} conversations x {shape['turns']} turns; system prompt {shape['system']} tokens, "
                  f"user {shape['user']}, reply {shape['reply']}; aligned = state kept every {shape['align']} tokens")
    t = Table(title="kvstate bench prefix")
    for col in ("policy", "prompt tokens", "computed", "vs off", "reused / ideal", "TTFT turn 1 ms",
                "TTFT turns 2+ ms", "TTFT 2+ speedup"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in table:
        t.add_row(r["policy"], str(r["prompt_tokens"]), str(r["computed_tokens"]), f"{r['computed_vs_off']:.2f}",
                  f"{100 * r['reuse_of_ideal']:.1f}%", f"{r['ttft_turn1_ms']:.0f}", f"{r['ttft_later_ms']:.0f}",
                  f"{r['ttft_later_speedup']:.1f}x")
    console.print(t)
    console.print("replies identical across policies: yes; targets (kvstate): "
                  + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in result["targets"].items()))
    return 0
