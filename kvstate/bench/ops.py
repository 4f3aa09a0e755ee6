"""`kvstate bench ops`: every op and form, timed against transformers' fallbacks where they exist.

Cases come from small modules (`kvstate.bench.ops_<group>`), each with
`cases(quick: bool) -> list[Case]`. For each case we print the shape, ms per call, tokens/s,
achieved GFLOP/s and its fraction of the measured GEMM rate (or GB/s against the measured
bandwidth for memory-bound decode forms), and the speed ratio against the reference.
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import dataclass, field
from typing import Callable

GROUPS = ("kvstate.bench.ops_delta", "kvstate.bench.ops_kda", "kvstate.bench.ops_ssm")


@dataclass
class Case:
    op: str  # e.g. "gated_delta_rule"
    form: str  # "chunk" | "recurrent" | "naive" | ...
    shape: str  # human-readable shape, e.g. "B=1 T=4096 H=16/32 K=V=128"
    tokens: int  # tokens processed per call
    setup: Callable[[], tuple[Callable[[], object], Callable[[], object] | None]]
    # setup() builds inputs once and returns (kvstate_fn, reference_fn or None)
    flops: float = 0.0  # useful FLOPs per call (0: not compute-bound)
    bytes: float = 0.0  # bytes that must move per call (state read + write, inputs, outputs)
    reference: str = ""  # name of the reference, e.g. "transformers torch_chunk_gated_delta_rule"
    target: str = ""  # the target, printed next to the ratio
    extra: dict = field(default_factory=dict)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small shapes, a few seconds in all")
    parser.add_argument("--only", default=None, help="comma-separated op names to run")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference timings")


def collect(quick: bool, only: set[str] | None) -> list[Case]:
    cases: list[Case] = []
    for module_name in GROUPS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        cases += [c for c in module.cases(quick) if only is None or c.op in only]
    return cases


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.progress import Progress
    from rich.table import Table

    from kvstate.bench.timing import start, time_fn

    only = set(args.only.split(",")) if args.only else None
    cases = collect(args.quick, only)
    console, limits = start(args)
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("bench ops", total=len(cases))
        for case in cases:
            progress.update(task, description=f"{case.op} {case.form}")
            fn, ref = case.setup()
            with torch.inference_mode():
                t = time_fn(fn, min_time=0.2 if args.quick else 1.0)
                t_ref = None
                if ref is not None and not args.no_reference:
                    t_ref = time_fn(ref, min_time=0.2 if args.quick else 1.0, max_iters=10)
            rows.append(dict(
                op=case.op, form=case.form, shape=case.shape, ms=t * 1e3, tokens_per_s=case.tokens / t,
                gflops=case.flops / t / 1e9 if case.flops else None,
                gemm_fraction=case.flops / t / limits.gemm_flops if case.flops else None,
                gbps=case.bytes / t / 1e9 if case.bytes else None,
                bandwidth_fraction=case.bytes / t / limits.bandwidth if case.bytes else None,
                reference=case.reference or None, ref_ms=t_ref * 1e3 if t_ref else None,
                speedup=t_ref / t if t_ref else None, target=case.target or None,
            ))
            progress.advance(task)
    machine = dict(gemm_gflops=limits.gemm_flops / 1e9, bandwidth_gbps=limits.bandwidth / 1e9,
                   threads=torch.get_num_threads())
    if args.json:
        print(json.dumps(dict(machine=machine, results=rows), indent=2))
        return 0
    console.print(f"machine: fp32 GEMM {machine['gemm_gflops']:.1f} GFLOP/s, "
                  f"memory bandwidth {machine['bandwidth_gbps']:.1f} GB/s, {machine['threads']} threads")
    table = Table(title="kvstate bench ops (fp32, CPU)" if not torch.cuda.is_available() else "kvstate bench ops")
    for col in ("op", "form", "shape", "ms", "tok/s", "GFLOP/s", "% GEMM", "GB/s", "% BW", "vs reference", "target"):
        table.add_column(col, justify="right" if col not in ("op", "form", "shape", "target") else "left")
    pct = lambda x: f"{100 * x:.0f}%" if x is not None else "-"  # noqa: E731
    num = lambda x, f: f.format(x) if x is not None else "-"  # noqa: E731
    for r in rows:
        table.add_row(r["op"], r["form"], r["shape"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                      num(r["gflops"], "{:.1f}"), pct(r["gemm_fraction"]), num(r["gbps"], "{:.1f}"),
                      pct(r["bandwidth_fraction"]),
                      f"{r['speedup']:.2f}x ({r['ref_ms']:.1f} ms)" if r["speedup"] else "-", r["target"] or "")
    console.print(table)
    return 0
