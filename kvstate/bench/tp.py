"""`kvstate bench tp`: tensor parallelism on CPU, TP 1 (one process, N threads) against TP N (N
processes of one thread each, gloo), on the same checkpoint and prompts, in one run.

Prefill: one prompt of `--prefill-len` tokens (time to its first token). Decode: `--batch`
requests, the time of generating `--new-tokens` minus the time of generating 1, over the steps
between. For TP N, the share of rank 0's step time spent in the forward's all-reduces and the
logits' all-gather (waiting for the slowest rank included). Greedy tokens must be identical at
TP 1 and TP N (they are checked). On a shared machine absolute numbers are noise: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import time

from kvstate.terminal.arg_types import count_arg, decode_tokens_arg, whole_number


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model, short prompts (seconds)")
    parser.add_argument("--tp", type=whole_number(2, "the parallel side"), default=2,
                        help="ranks of the parallel side (default 2)")
    parser.add_argument("--batch", type=count_arg, default=4, help="decode batch (default 4)")
    parser.add_argument("--new-tokens", type=decode_tokens_arg, default=None,
                        help="decode tokens per request (default 16; quick 4)")
    parser.add_argument("--prefill-len", type=count_arg, default=None,
                        help="prefill prompt tokens (default 512; quick 64)")


def _measure(llm, prefill: list[int], prompts: list[list[int]], new: int, group=None) -> dict:
    from kvstate.engine.params import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate([prefill[:16]], one)  # warm up
    t0 = time.perf_counter()
    llm.generate([prefill], one)
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    t_first = time.perf_counter() - t0
    if group is not None:
        group.seconds = dict.fromkeys(group.seconds, 0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, many)
    t_all = time.perf_counter() - t0
    decode = max(t_all - t_first, 1e-9)
    row = {"prefill_tok_s": len(prefill) / t_prefill, "decode_tok_s": len(prompts) * (new - 1) / decode,
           "tokens": [o.outputs[0].token_ids for o in outs]}
    if group is not None:  # collectives of the whole decode run (its prefill step too) over its time
        row["all_reduce_share"] = group.seconds["all-reduce"] / t_all
        row["all_gather_share"] = group.seconds["all-gather"] / t_all
    return row


def run(args: argparse.Namespace) -> int:
    import os
    import tempfile

    import torch

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.llm import LLM
    from kvstate.errors import KvstateError

    if args.tp < 2:
        raise KvstateError(f"--tp: the parallel side needs at least 2 ranks, got {args.tp}")
    new = args.new_tokens or (4 if args.quick else 16)
    plen = args.prefill_len or (64 if args.quick else 512)
    threads = args.threads or args.tp
    size = "quick" if args.quick else "0.5b"
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-tp-") as tmp:
        path, hf = qwen3_5_checkpoint(size, tmp)
        vocab = hf.config.vocab_size
        del hf
        prefill = torch.randint(3, vocab, (plen,), generator=g).tolist()
        prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(args.batch)]
        torch.set_num_threads(threads)
        llm = LLM(path, cache_memory="1GiB", max_num_seqs=max(args.batch, 1))
        single = _measure(llm, prefill, prompts, new)
        del llm
        torch.set_num_threads(args.tp)  # spawn_workers gives each rank threads // tp = 1
        llm = LLM(path, cache_memory="1GiB", max_num_seqs=max(args.batch, 1), tensor_parallel_size=args.tp)
        try:
            parallel = _measure(llm, prefill, prompts, new, group=llm.runner.group)
        finally:
            llm.close()
            torch.set_num_threads(threads)
    same = single.pop("tokens") == parallel.pop("tokens")
    load = os.getloadavg()[0]
    result = {"model": f"random Qwen3.5-style {size}", "tp": args.tp, "threads_tp1": threads, "threads_per_rank": 1,
              "batch": args.batch, "new_tokens": new, "prefill_len": plen, "tp1": single, f"tp{args.tp}": parallel,
              "prefill_ratio": parallel["prefill_tok_s"] / single["prefill_tok_s"],
              "decode_ratio": parallel["decode_tok_s"] / single["decode_tok_s"], "same_tokens": same,
              "load_average": load}
    if args.json:
        print(json.dumps(result))
    else:
        _print(result, args.tp)
    return 0 if same else 1


def _print(r: dict, tp: int) -> None:
    from rich.table import Table

    from kvstate.terminal.console import make_console

    p = r[f"tp{tp}"]
    table = Table(title=f"{r['model']}: TP 1 ({r['threads_tp1']} threads) vs TP {tp} ({tp} processes x 1 thread)",
                  title_justify="left")
    for col in ("", "TP 1 tok/s", f"TP {tp} tok/s", f"TP {tp} / TP 1"):
        table.add_column(col, justify="left" if not col else "right")
    table.add_row(f"prefill ({r['prefill_len']} tokens)", f"{r['tp1']['prefill_tok_s']:.1f}",
                  f"{p['prefill_tok_s']:.1f}", f"{r['prefill_ratio']:.2f}x")
    table.add_row(f"decode (batch {r['batch']})", f"{r['tp1']['decode_tok_s']:.1f}", f"{p['decode_tok_s']:.1f}",
                  f"{r['decode_ratio']:.2f}x")
    console = make_console()
    console.print(table)
    console.print(f"TP {tp} decode run: all-reduce {100 * p['all_reduce_share']:.1f}% of the time, logits all-gather "
                  f"{100 * p['all_gather_share']:.1f}% (rank 0, waiting for the slowest rank included); greedy tokens "
                  f"{'identical' if r['same_tokens'] else 'DIFFERENT'}; load average {r['load_average']:.2f}",
                  soft_wrap=True)
