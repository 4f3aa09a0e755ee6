"""`kvstate bench prefix`: prefix caching per snapshot policy, on serving workloads and multi-turn chats.

The serving workloads (a shared document, a repeat, a shared system prompt: `prefix_serving`) say
where the second request resumes. The chats: 3 conversations x 3 turns share one system prompt
(token ids, seeded); each turn appends a user message to the conversation so far and generates a
greedy reply, one request at a time, so time to first token is the prefill the policy leaves to
compute. Policies (`prefix_serving.POLICIES`), one engine core each over one loaded checkpoint (a
random ~0.5B Qwen3.5-style one; `--quick`: small): off, aligned (vLLM: state kept only at multiples
of 512 tokens), prompt-end (kvstate before snapshots at length - 1 and message ends), kvstate (the default).

Reported for the chats per policy: prompt tokens computed, the share of the ideally reusable prompt
tokens reused (ideal: each prompt's longest common prefix with any earlier conversation, one token
left to compute), mean time to first token of turn 1 and of turns 2-6, and ratios to "off". The
replies of all policies must be the same tokens (prefix caching is exact). Each prompt runs through
the policies' engines back to back, so a load that drifts on a shared machine weighs on all alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time

from kvstate.models.tokenizer import common_prefix
from kvstate.terminal.arg_types import seed_arg

from kvstate.bench import prefix_first as first
from kvstate.bench import prefix_serving as serving

POLICIES = serving.POLICIES
SHAPES = {  # conversations, turns, system prompt, user message, reply tokens, alignment of "aligned"
    "full": dict(convs=3, turns=3, system=512, user=96, reply=8, align=512),
    "quick": dict(convs=3, turns=3, system=40, user=12, reply=4, align=64),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model and short conversations (seconds)")
    parser.add_argument("--seed", type=seed_arg, default=0, help="seed of the conversations' token ids")
    parser.add_argument("--first-request-only", action="store_true",
                        help="measure only a first request's time to first token with caching off and on")


def make_engine(model, plan, policy: str, shape: dict):
    """The engine core of one policy: room for every conversation's KV and three snapshots per
    conversation (eviction is not what is measured)."""
    longest = shape["system"] + shape["turns"] * (shape["user"] + shape["reply"]) + 8
    return serving.make_core(model, plan, policy, dict(shape, longest=longest, slots=3 * shape["convs"],
                                                             kv_seqs=shape["convs"] + 2))


def run_policies(model, plan, shape: dict, seed: int, console) -> list[dict]:
    """Every prompt of the workload through every policy's engine, one right after the other (a load
    that drifts on a shared machine then weighs on all policies alike); rows per policy."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    engines = {p: make_engine(model, plan, p, shape) for p in POLICIES}
    rng = random.Random(seed)
    system = [rng.randrange(10, plan.vocab_size) for _ in range(shape["system"])]
    params = shape["reply"]
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
    bounds = {len(system): "chat"}  # the system prompt's end: a message boundary
    ids = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    chats = [list(system) for _ in range(shape["convs"])]
    history: list[list[int]] = []
    for turn in range(shape["turns"]):
        for c, chat in enumerate(chats):
            chat += ids(shape["user"])
            ideal = max([min(common_prefix(chat, h), len(chat) - 1) for h in history] or [0])
            replies = []
            for policy, llm in engines.items():
                out = serving.serve(llm, list(chat), dict(bounds) if serving.takes_hints(policy) else None, params)
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

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.bench.timing import start
    from kvstate.models.loader import load_model

    console, _ = start(args)
    size = "quick" if args.quick else "full"
    shape = SHAPES[size]
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-prefix-") as tmp:
        with console.status("building checkpoint"):
            path, hf = qwen3_5_checkpoint("quick" if args.quick else "0.5b", tmp)
            del hf
            gc.collect()
            model, plan = load_model(path)
    started = time.perf_counter()
    def progress(workload, rows):  # the serving part has no bar (each request runs alone): say what is done
        print(f"bench prefix: {workload} request {len(rows['off'])} done, "
              f"{time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    def done(workload, rows):  # each workload's rows as soon as they are measured (a long run may be cut short)
        print(f"bench prefix: {workload}: {json.dumps(rows)}", file=sys.stderr, flush=True)

    with console.status("first request: caching off and on, alternating"):
        first_row = first.run(model, plan, first.SHAPES[size], serving.SHAPES[size], args.seed)
    if args.first_request_only:
        result = {"first_request": first_row, "seconds": time.perf_counter() - started}
        print(json.dumps(result, indent=2)) if args.json else print_first(console, first_row)
        return 0
    serving_table = serving.run_workloads(model, plan, serving.SHAPES[size], args.seed, progress, done)
    results = run_policies(model, plan, shape, args.seed, console)
    table = [summarize(res) for res in results]
    off = table[0]
    for row in table:
        row["computed_vs_off"] = row["computed_tokens"] / off["computed_tokens"]
        row["ttft_later_speedup"] = off["ttft_later_ms"] / row["ttft_later_ms"]
    ours, before = table[-1], next(r for r in table if r["policy"] == "prompt-end")
    result = {"shape": shape, "serving_shape": serving.SHAPES[size], "serving": serving_table, "policies": table,
              "first_request": first_row,
              "replies_identical": True, "seconds": time.perf_counter() - started,
              "targets": {**serving.targets(serving_table),
                          "chats: computed <= prompt-end's": ours["computed_tokens"] <= before["computed_tokens"],
                          "chats: reuse_of_ideal >= 0.9": ours["reuse_of_ideal"] >= 0.9,
                          "first request with snapshot points <= 1.05x off": first_row["ratio"] <= 1.05}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print_tables(console, result)
    return 0


def print_first(console, row: dict) -> None:
    from rich.table import Table

    t = Table(title=f"kvstate bench prefix: a first request of {row['prompt']} tokens, cache_prefix at "
                    f"{', '.join(map(str, row['points']))} ({row['rounds']} alternating rounds)")
    for col in ("caching", "TTFT per round ms", "median ms", "vs off"):
        t.add_column(col, justify="left" if col == "caching" else "right")
    for name, key, ratio in (("off", "off", 1.0), ("on", "on", row["ratio"])):
        t.add_row(name, " ".join(f"{x:.0f}" for x in row[f"ttft_{key}_ms"]), f"{row[f'median_{key}_ms']:.0f}",
                  f"{ratio:.3f}x")
    console.print(t)


def print_tables(console, result: dict) -> None:
    from rich.table import Table

    from kvstate.memory import format_bytes

    print_first(console, result["first_request"])
    sv = result["serving_shape"]
    console.print(f"serving: document {sv['doc']} tokens + questions of {sv['question']} ({sv['clients']} clients); "
                  f"repeat: {sv['prompt']} tokens twice; system prompt {sv['system']} + turns of {sv['turn']} "
                  f"({sv['users']} users); {sv['slots']} snapshot slots per policy")
    t = Table(title="kvstate bench prefix: serving workloads (second request)")
    for col in ("workload", "policy", "computed (all)", "2nd computes", "2nd own", "TTFT 1st ms", "TTFT 2nd ms",
                "1st / 2nd", "snapshots held", "misses by reason"):
        t.add_column(col, justify="left" if col in ("workload", "policy") else "right")
    for workload, rows in result["serving"].items():
        for policy, r in rows.items():
            t.add_row(workload, policy, str(r["computed"]), str(r["second_computed"]), str(r["second_own"]),
                      f"{r['ttft_first_ms']:.0f}", f"{r['ttft_second_ms']:.0f}", f"{r['ttft_speedup']:.1f}x",
                      f"{r['snapshots_held']} ({format_bytes(r['snapshot_bytes'])})",
                      ", ".join(f"{k} {v}" for k, v in r["misses"].items()) or "-")
    console.print(t)
    shape = result["shape"]
    console.print(f"chats: {shape['convs']} conversations x {shape['turns']} turns; system prompt {shape['system']} "
                  f"tokens, user {shape['user']}, reply {shape['reply']}; aligned = state kept every "
                  f"{shape['align']} tokens")
    t = Table(title="kvstate bench prefix: multi-turn chats")
    for col in ("policy", "prompt tokens", "computed", "vs off", "reused / ideal", "TTFT turn 1 ms",
                "TTFT turns 2+ ms", "TTFT 2+ speedup"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in result["policies"]:
        t.add_row(r["policy"], str(r["prompt_tokens"]), str(r["computed_tokens"]), f"{r['computed_vs_off']:.2f}",
                  f"{100 * r['reuse_of_ideal']:.1f}%", f"{r['ttft_turn1_ms']:.0f}", f"{r['ttft_later_ms']:.0f}",
                  f"{r['ttft_later_speedup']:.1f}x")
    console.print(t)
    console.print("replies identical across policies: yes; targets (kvstate): "
                  + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in result["targets"].items()))
