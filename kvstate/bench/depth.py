"""`kvstate bench engine --depth N[,M...]`: decode and prefill after a long context, as llama-bench's `-d N`.

For each depth N, at batch 1, with the engine's prefill chunked into `--prefill-len` (P) tokens a
step (so every chunk's cost is one step's, and llama.cpp's batch is the same size):
- decode: a prompt of N tokens, then `--new-tokens` steps; tokens/s of the steps after the first
  token (the context grows from N to N + new);
- prefill at depth: a prompt of N + P tokens; the last step is exactly the P tokens at depth N
  (N must be a multiple of P for that: the chunks are P, P, ..., P);
- the prompt's prefill from zero (N tokens) comes with the decode run.
llama.cpp's side: `llama-bench -p P -n GEN -d N,... -r 1` (it re-runs the depth's prompt before every
test, so one repetition keeps it to minutes). With `--rounds R` the two sides take turns R times
(new prompts each round) and each ratio is also given as the median of its R rounds; the table shows
the first round.
"""

from __future__ import annotations

import contextlib
import dataclasses

from kvstate.errors import KvstateError


def check_depths(depths: list[int], prefill_len: int) -> None:
    """Each depth a multiple of the prefill chunk: one line naming the first that is not."""
    for n in depths:
        if n % prefill_len:
            raise KvstateError(f"--depth {n}: a multiple of --prefill-len ({prefill_len}) is needed (the prefill "
                               f"measured is the {prefill_len} tokens after the depth, one chunk of that size)")


@contextlib.contextmanager
def chunk_budget(llm, tokens: int):
    """The engine's step budget (max_num_batched_tokens) set to `tokens` inside the block."""
    scheduler = llm.engine.scheduler
    before = scheduler.config
    scheduler.config = dataclasses.replace(before, max_num_batched_tokens=tokens)
    try:
        yield
    finally:
        scheduler.config = before


def measure(llm, depths: list[int], *, prefill_len: int, new: int, generator, status) -> list[dict]:
    """One row per depth: decode tokens/s after N tokens, prefill tokens/s of P more at depth N, and
    the N-token prompt's own prefill rate. `status(text)` is a context manager (the console's)."""
    import torch

    from kvstate.bench.timing import timed_generate

    vocab = llm.plan.vocab_size
    rows = []
    for n in depths:
        ids = torch.randint(0, vocab, (n + prefill_len,), generator=generator).tolist()
        chunks = n // prefill_len
        with chunk_budget(llm, prefill_len):
            with status(f"depth {n}: prefill, then {new} decode steps"):
                total, steps = timed_generate(llm, [ids[:n]], new)
            with status(f"depth {n}: prefill of {prefill_len} more tokens"):
                _, deep = timed_generate(llm, [ids], 1)
        if len(steps) != chunks + new - 1 or len(deep) != chunks + 1:  # the chunking this relies on
            raise KvstateError(f"--depth {n}: the engine took {len(steps)} and {len(deep)} steps, not "
                               f"{chunks + new - 1} and {chunks + 1} (chunks of {prefill_len})")
        decode_s = (total - sum(steps[:chunks])) / (new - 1)
        rows.append(dict(depth=n, decode_tokens_per_s=1 / decode_s, decode_ms_per_step=1e3 * decode_s,
                         prefill_tokens=prefill_len, prefill_tokens_per_s=prefill_len / deep[-1],
                         prefill_ms=1e3 * deep[-1], prompt_tokens_per_s=n / sum(steps[:chunks])))
    return rows


def engine_part(args, console, llm, depths, prefill_len, new) -> dict:
    """--depth's part of the result: our rows, llama-bench's at the same depths, and their ratios (the
    first round's), and with --rounds R > 1 and --llama-bench each ratio over R alternating rounds."""
    import statistics

    import torch

    if not depths:
        return dict(depth=[], llama_cpp_depth=[], vs_llama_cpp_depth={}, depth_rounds={})
    generator = torch.Generator().manual_seed(2)
    n_rounds = args.rounds if args.llama_bench else 1
    rounds = []  # (our rows, llama-bench's rows, ratios) per round
    for i in range(n_rounds):
        tag = f" (round {i + 1} of {n_rounds})" if n_rounds > 1 else ""
        rows = measure(llm, depths, prefill_len=prefill_len, new=new, generator=generator,
                       status=lambda text: console.status(text + tag))
        theirs, ratios = [], {}
        if args.llama_bench:
            with console.status(f"llama.cpp: llama-bench -d {','.join(map(str, depths))}{tag}"):
                theirs, ratios = llama_depths(args.llama_bench, args.gguf, rows, threads=torch.get_num_threads(),
                                              prompt=prefill_len, gen=args.llama_gen)
        rounds.append((rows, theirs, ratios))
    rows, theirs, ratios = rounds[0]
    by_round = {}
    if n_rounds > 1:
        for label in ratios:
            values = [r[label] for _, _, r in rounds if label in r]
            by_round[label] = dict(ratios=values, median=statistics.median(values))
    return dict(depth=rows, llama_cpp_depth=theirs, vs_llama_cpp_depth=ratios, depth_rounds=by_round)


def show(console, result: dict) -> None:
    """The --depth table: ours, then llama.cpp's at the same depths, then the ratios."""
    from rich.table import Table

    if not result.get("depth"):
        return
    table = Table(title="at depth (batch 1)")
    for col in ("impl", "depth", "decode tok/s", "prefill", "prefill tok/s", "prompt tok/s"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for r in result["depth"]:
        table.add_row(f"kvstate {result['weight_dtype']}", f"{r['depth']:,}", f"{r['decode_tokens_per_s']:.1f}",
                      str(r["prefill_tokens"]), f"{r['prefill_tokens_per_s']:.1f}", f"{r['prompt_tokens_per_s']:.1f}")
    for r in result.get("llama_cpp_depth", []):
        decode = r["test"].startswith("tg")
        table.add_row(f"llama.cpp {r['gguf']} {r['test'].split(' @ ')[0]}", f"{r['depth']:,}",
                      f"{r['tokens_per_s']:.1f}" if decode else "-", "-" if decode else r["test"][2:].split()[0],
                      "-" if decode else f"{r['tokens_per_s']:.1f}", "-")
    console.print(table)
    rounds = result.get("depth_rounds") or {}
    for k, v in result.get("vs_llama_cpp_depth", {}).items():
        if k in rounds:
            each = ", ".join(f"{x:.2f}" for x in rounds[k]["ratios"])
            console.print(f"kvstate ({result['weight_dtype']}) / llama.cpp, {k}, {len(rounds[k]['ratios'])} "
                          f"alternating rounds: median {rounds[k]['median']:.2f}x ({each})")
        else:
            console.print(f"kvstate ({result['weight_dtype']}) / llama.cpp, {k}: {v:.2f}x")


def llama_depths(binary: str, ggufs: list[str], rows: list[dict], *, threads: int, prompt: int,
                 gen: int) -> tuple[list[dict], dict[str, float]]:
    """llama-bench at the same depths -> (its rows, {label: kvstate tokens/s / llama.cpp's})."""
    from pathlib import Path

    from kvstate.bench.llama_cpp import run_llama_bench

    ours = {r["depth"]: r for r in rows}
    out, ratios = [], {}
    for gguf in ggufs:
        name = Path(gguf).name
        for r in run_llama_bench(binary, gguf, threads=threads, prompt=prompt, gen=gen, depths=sorted(ours),
                                 repetitions=1):
            out.append(dict(gguf=name, test=r.test, depth=r.depth, tokens_per_s=r.tokens_per_s))
            mine = ours.get(r.depth)
            if mine is None or r.tokens_per_s <= 0:
                continue
            decode = r.test.startswith("tg")
            value = mine["decode_tokens_per_s" if decode else "prefill_tokens_per_s"]
            ratios[f"{'decode b=1' if decode else 'prefill'} @ d{r.depth} vs {name} {r.test}"] = value / r.tokens_per_s
    return out, ratios
