"""`kvstate bench prompt-logprobs`: what scoring a prompt costs over prefilling it.

One engine over a random ~0.5B Qwen3.5-style checkpoint (`--quick`: small). Each round runs a
fresh random prompt of `--prompt-len` tokens twice, in turn: plain (max_tokens 1) and with
prompt_logprobs=1 (max_tokens 1: the prompt's logprob and rank at every position, the most likely
token beside), so a load that drifts on a shared machine weighs on both alike. Reported: the best
and median seconds of each and the ratio of the medians (the target is <= 1.3x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvstate.terminal.arg_types import count_arg


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model and a short prompt (seconds)")
    parser.add_argument("--prompt-len", type=count_arg, default=None, help="prompt tokens (default 512; quick 64)")
    parser.add_argument("--rounds", type=count_arg, default=5, help="alternating rounds (default: 5)")


def _engine(size: str, t: int):
    """An LLM over a fresh random checkpoint (its files gone once loaded)."""
    import tempfile

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.llm import LLM

    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp:
        path, _ = qwen3_5_checkpoint(size, tmp)
        return LLM(path, cache_memory="1GiB", max_model_len=t + 8, max_num_batched_tokens=max(2048, t))


def run(args: argparse.Namespace) -> int:
    import random

    import torch
    from rich.table import Table

    from kvstate.bench.timing import start
    from kvstate.engine.params import SamplingParams

    console, _ = start(args)
    t = args.prompt_len or (64 if args.quick else 512)
    size = "quick" if args.quick else "0.5b"
    with console.status("building checkpoint"):
        llm = _engine(size, t)
    vocab = llm.plan.vocab_size
    rng = random.Random(0)
    kinds = {"plain prefill": SamplingParams(temperature=0, max_tokens=1),
             "prompt_logprobs=1": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    llm.generate([[rng.randrange(vocab) for _ in range(t)]], kinds["prompt_logprobs=1"])  # warm up
    for r in range(args.rounds):
        ids = [rng.randrange(vocab) for _ in range(t)]
        for name, params in kinds.items():
            with console.status(f"round {r + 1}/{args.rounds}: {name}"):
                t0 = time.perf_counter()
                out = llm.generate([ids], params)[0]
                times[name].append(time.perf_counter() - t0)
            assert out.error is None, out.error
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["prompt_logprobs=1"] / med["plain prefill"]
    result = dict(model=f"random Qwen3.5-style {size} (vocab {vocab})", prompt_tokens=t, rounds=args.rounds,
                  threads=torch.get_num_threads(),
                  rows=[dict(kind=k, best_s=min(v), median_s=med[k]) for k, v in times.items()], ratio=ratio)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    table = Table(title=f"kvstate bench prompt-logprobs: {t}-token prompt, {result['model']}, "
                        f"{result['threads']} threads, {args.rounds} alternating rounds")
    for col in ("request", "best s", "median s"):
        table.add_column(col, justify="left" if col == "request" else "right")
    for row in result["rows"]:
        table.add_row(row["kind"], f"{row['best_s']:.3f}", f"{row['median_s']:.3f}")
    console.print(table)
    console.print(f"prompt_logprobs=1 / plain prefill: {ratio:.2f}x (medians)")
    return 0
