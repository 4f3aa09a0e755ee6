"""`kvstate bench linear`: the decode-sized linears of the "0.5b" bench model, kvstate's kernels
against torch's F.linear, fp32, bf16 and int8 weights, in one process on the same inputs.

One "step" runs every nn.Linear of the model once (as one decode step does) on x of M rows, with
all the weights resident at once (2.1 GB in fp32), so they stream from memory, not from cache.
Printed per weight dtype and M: ms per step, GB/s of weights streamed and the fraction of the
machine's measured read bandwidth (a `sum` over 1 GiB), tokens/s, and the ratio to torch
(fp32: F.linear on the fp32 weights; bf16: torch's own bf16 path, x rounded to bf16; int8, per-row
scales: F.linear on the dequantized fp32 weights).
"""

from __future__ import annotations

import argparse
import json


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the small sibling model (seconds; weights in cache)")
    parser.add_argument("--rows", default="1,8,16,32", help="rows of x (decode batch sizes)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="weight dtypes: fp32, bf16, int8 (default: fp32,bf16)")


def model_linears(size: str) -> list[tuple[str, int, int]]:
    """(name, out_features, in_features) of every nn.Linear of the bench checkpoint, built on the meta
    device by transformers (no memory, no weights), with the layer mix of kvstate.bench.checkpoints."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from kvstate.bench.checkpoints import SIZES

    dims = SIZES[size]
    n = dims["num_hidden_layers"]
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(layer_types=layer_types, **dims))
    return [(name, m.out_features, m.in_features) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def kernel_path(info: dict, dtype: str, rows: int) -> str:
    """Which code computes these rows (mirrors kernels.dispatch and the extension's ISA choice)."""
    from kvstate import kernels

    limit = kernels.MAX_ROWS if dtype == "fp32" else kernels.MAX_ROWS_BF16
    if info["backend"] == "torch" or rows > limit:
        return "torch"
    isa = info["isa"]
    if isa == "amx" and (dtype == "fp32" or rows < 3):  # AMX: bf16 or int8 weights, 3 or more rows a call
        isa = "avx512"
    return isa


def interleaved(fns, min_time: float, rounds: int = 3) -> list[float]:
    """Seconds per call of each fn: the best of `rounds` medians, the fns taking turns, so that a
    burst of load from other processes does not land on one side only."""
    from kvstate.bench.timing import time_fn

    times = [[] for _ in fns]
    for r in range(rounds):
        for i, fn in enumerate(fns):
            times[i].append(time_fn(fn, warmup=int(r == 0), min_time=min_time / rounds))
    return [min(t) for t in times]


def read_bandwidth(mib: int) -> float:
    """Bytes/s of a plain read: torch's sum over `mib` MiB (every byte read once, nothing written)."""
    import torch

    from kvstate.bench.timing import time_fn

    a = torch.ones(mib * 2**20 // 4)
    return a.numel() * 4 / time_fn(lambda: a.sum(), warmup=2, min_time=0.5)


def run(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from kvstate import kernels
    from kvstate.bench.timing import start
    from kvstate.errors import KvstateError
    from kvstate.kernels.quant import dequantize, quantize_rows

    wanted = [d.strip() for d in args.dtypes.split(",")]
    if not wanted or any(d not in ("fp32", "bf16", "int8") for d in wanted):
        raise KvstateError(f"--dtypes {args.dtypes!r}: a comma-separated list of fp32, bf16, int8")
    console, limits = start(args)
    size = "quick" if args.quick else "0.5b"
    min_time = 0.1 if args.quick else 1.0
    rows_list = [int(r) for r in args.rows.split(",")]
    with console.status("measuring the read bandwidth"):
        read_bw = read_bandwidth(64 if args.quick else 1024)
    shapes = model_linears(size)
    g = torch.Generator().manual_seed(0)
    with console.status(f"allocating the weights of {len(shapes)} linears"):
        w32 = [torch.randn(n, k, generator=g) * k**-0.5 for _, n, k in shapes]
        # (weight, per-row scale or None) per linear
        weights = {d: [(w, None) if d == "fp32" else (w.bfloat16(), None) if d == "bf16" else quantize_rows(w)
                       for w in w32] for d in wanted}
    info = kernels.info()
    results = []
    for d in wanted:
        ws = weights[d]
        nbytes = sum(w.numel() * w.element_size() + (s.numel() * 4 if s is not None else 0) for w, s in ws)
        ref_ws = [dequantize(w, s) for w, s in ws] if d == "int8" else [w for w, _ in ws]
        for m in rows_list:
            xs = {k: torch.randn(m, k, generator=g) for k in {w.shape[1] for w, _ in ws}}
            triples = [(xs[w.shape[1]], w, s) for w, s in ws]
            xs16 = {k: x.bfloat16() for k, x in xs.items()}
            ref_pairs = [((xs16 if d == "bf16" else xs)[w.shape[1]], w) for w in ref_ws]

            def ours():
                for x, w, s in triples:
                    kernels.linear(x, w, None, s)

            def theirs():
                for x, w in ref_pairs:
                    F.linear(x, w)

            with console.status(f"{d} weights, M={m}"), torch.inference_mode():
                t, t_ref = interleaved([ours, theirs], min_time)
            path = kernel_path(info, d, m)
            results.append(dict(dtype=d, rows=m, path=path, ms=1e3 * t, gbps=nbytes / t / 1e9,
                                read_fraction=nbytes / t / read_bw, tokens_per_s=m / t, torch_ms=1e3 * t_ref,
                                speedup_vs_torch=t_ref / t))
    for r in results:  # time of M rows / time of 1 row, same dtype
        one = next((o for o in results if o["dtype"] == r["dtype"] and o["rows"] == 1), None)
        r["vs_one_row"] = r["ms"] / one["ms"] if one else None
    out = dict(model=f"random Qwen3.5-style {size}: {len(shapes)} linears, "
                     f"{sum(n * k for _, n, k in shapes) / 1e6:.0f}M weights",
               kernels=info, threads=torch.get_num_threads(),
               machine=dict(read_gbps=read_bw / 1e9, bandwidth_gbps=limits.bandwidth / 1e9,
                            gemm_gflops=limits.gemm_flops / 1e9),
               rows=results)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    _print(console, out, wanted)
    return 0


def _print(console, out: dict, wanted: list[str]) -> None:
    """The table of `run`'s result (--json's form) and its two ratios."""
    from rich.table import Table

    info, machine = out["kernels"], out["machine"]
    console.print(f"{out['model']}; {out['threads']} threads; kernels: {info['backend']} {info['isa'] or ''} "
                  f"{info['reason'] or ''}; read bandwidth {machine['read_gbps']:.1f} GB/s, copy "
                  f"{machine['bandwidth_gbps']:.1f} GB/s", soft_wrap=True)
    table = Table(title="kvstate bench linear: one decode step's linears")
    for col in ("weights", "M", "path", "ms", "GB/s", "% read", "tok/s", "vs M=1", "torch ms", "x torch"):
        table.add_column(col, justify="left" if col in ("weights", "path") else "right")
    for r in out["rows"]:
        table.add_row(r["dtype"], str(r["rows"]), r["path"], f"{r['ms']:.1f}", f"{r['gbps']:.1f}",
                      f"{100 * r['read_fraction']:.0f}%", f"{r['tokens_per_s']:.1f}",
                      f"{r['vs_one_row']:.2f}" if r["vs_one_row"] else "-", f"{r['torch_ms']:.1f}",
                      f"{r['speedup_vs_torch']:.2f}")
    console.print(table)
    speed = {(r["dtype"], r["rows"]): r for r in out["rows"]}
    if ("fp32", 1) in speed and ("bf16", 1) in speed:
        ratio = speed["bf16", 1]["tokens_per_s"] / speed["fp32", 1]["tokens_per_s"]
        console.print(f"bf16 / fp32 weights, M=1: {ratio:.2f}x the tokens/s")
    for d in wanted:
        if (d, 8) in speed:
            console.print(f"{d}: M=8 costs {speed[d, 8]['vs_one_row']:.2f}x the time of M=1")
