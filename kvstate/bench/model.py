"""`kvstate bench model`: prefill tokens/s of kvstate against transformers on the same checkpoint.

Both sides run the same random Qwen3.5-style checkpoint in fp32 in one process on the same
prompt; transformers keeps only the last position's logits (as kvstate does). We print tokens/s,
the speed ratio and the achieved GFLOP/s against this machine's measured fp32 GEMM rate. FLOPs
are the useful ones: every projection (2 x in x out per token), causal attention
(2 x 2 x T^2 / 2 x heads x head_dim) and the gated delta rule's state read/write
(4 x K x V per token and value head) plus its intra-chunk matmuls (2 x C x (K + V) per token).
"""

from __future__ import annotations

import argparse
import json

from kvstate.terminal.arg_types import count_arg
from kvstate.terminal.engine_args import add_weight_dtype


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model and a short prompt (seconds)")
    parser.add_argument("--prompt-len", type=count_arg, default=None, help="prompt tokens (default 2048; quick 256)")
    parser.add_argument("--repeats", type=count_arg, default=2, help="timed runs per side (best is reported)")
    add_weight_dtype(parser)  # kvstate's weight matrices; transformers stays fp32


def prefill_flops(plan, t: int, chunk: int = 64) -> float:
    hidden = plan.hidden_size
    total = 2.0 * hidden * plan.vocab_size  # LM head, last position only
    for layer in plan.layers:
        for m in layer.mixers:
            if m.kind == "attention":
                q_out = m.num_heads * m.head_dim * (2 if m.output_gate else 1)
                proj = hidden * (q_out + 2 * m.num_kv_heads * m.head_dim) + m.num_heads * m.head_dim * hidden
                total += 2.0 * proj * t + 2.0 * t * t * m.num_heads * m.head_dim
            elif m.kind == "gated_deltanet":
                kd, vd = m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim
                proj = hidden * (2 * kd + 2 * vd + 2 * m.num_v_heads) + vd * hidden
                per_tok = m.num_v_heads * (4 * m.head_k_dim * m.head_v_dim + 2 * chunk * (m.head_k_dim + m.head_v_dim))
                total += 2.0 * proj * t + per_tok * t
        if layer.ffn.kind == "mlp":
            total += 2.0 * 3 * hidden * layer.ffn.intermediate_size * t
    return total


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch
    from rich.table import Table

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.bench.timing import start
    from kvstate.models.batch import Batch
    from kvstate.models.generate import contiguous_caches
    from kvstate.models.loader import load_model

    console, limits = start(args)
    size = "quick" if args.quick else "0.5b"
    t = args.prompt_len or (256 if args.quick else 2048)
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp, console.status("building checkpoint"):
        path, hf = qwen3_5_checkpoint(size, tmp)
        model, plan = load_model(path, weight_dtype=args.weight_dtype)
    ids = torch.randint(0, plan.vocab_size, (t,), generator=torch.Generator().manual_seed(0))
    caches = contiguous_caches(model, 1, t)
    batch = Batch.build([t], [0], [0], [[0]], t)

    def ours():
        return model(ids, batch, caches)

    def theirs():
        return hf(ids[None], use_cache=True, logits_to_keep=1).logits

    import time

    times = {}
    with torch.inference_mode():
        diff = float((ours()[-1] - theirs()[0, -1]).norm() / theirs()[0, -1].norm())
        for name, fn in (("kvstate", ours), ("transformers", theirs)):
            best = float("inf")
            for _ in range(args.repeats):
                with console.status(f"prefill {t} tokens: {name}"):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
            times[name] = best
    flops = prefill_flops(plan, t)
    rows = [dict(impl=name, seconds=s, tokens_per_s=t / s, gflops=flops / s / 1e9,
                 gemm_fraction=flops / s / limits.gemm_flops) for name, s in times.items()]
    speedup = times["transformers"] / times["kvstate"]
    result = dict(model=f"random Qwen3.5-style {size} ({plan.params.total / 1e9:.2f}B params, {plan.layer_string})",
                  prompt_tokens=t, machine=dict(gemm_gflops=limits.gemm_flops / 1e9,
                                                bandwidth_gbps=limits.bandwidth / 1e9,
                                                threads=torch.get_num_threads()),
                  rows=rows, speedup=speedup, last_logits_rel_diff=diff)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console.print(f"{result['model']}, prefill {t} tokens, weights "
                  f"{str(model.lm_head.weight.dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads; "
                  "machine: fp32 GEMM "
                  f"{limits.gemm_flops / 1e9:.1f} GFLOP/s, bandwidth {limits.bandwidth / 1e9:.1f} GB/s")
    table = Table(title="kvstate bench model: prefill")
    for col in ("impl", "s", "tokens/s", "GFLOP/s", "% GEMM"):
        table.add_column(col, justify="left" if col == "impl" else "right")
    for r in rows:
        table.add_row(r["impl"], f"{r['seconds']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['gflops']:.1f}",
                      f"{100 * r['gemm_fraction']:.0f}%")
    console.print(table)
    console.print(f"kvstate / transformers prefill speed: {speedup:.2f}x  (last-token logits rel. diff {diff:.1e})")
    return 0
