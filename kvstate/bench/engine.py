"""`kvstate bench engine`: decode and prefill throughput of the engine against transformers' generate().

Same random Qwen3.5-style checkpoint and the same prompts on both sides, in one process, fp32.
Decode speed is measured the same way for both: the time of generating N tokens minus the time
of generating 1 (prefill + first token), over N - 1 steps. Bytes per decode step are what must be
read once: every weight matrix (embedding rows aside), each sequence's recurrent and conv state,
and its KV so far; GB/s is reported against the machine's measured memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a small model, short prompts (seconds)")
    parser.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    parser.add_argument("--prompt-len", type=int, default=None, help="prompt tokens per request (default 128; quick 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per request (default 32; quick 8)")
    parser.add_argument("--prefill-len", type=int, default=None, help="prompt of the prefill measurement (default 1024)")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers")


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads: all parameters but the embedding table (tied heads count once)."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or name.startswith("embed_tokens"):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    if model.lm_head.weight is model.embed_tokens.weight:
        total += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return total


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch
    from rich.table import Table

    from kvstate.bench.checkpoints import qwen3_5_checkpoint
    from kvstate.bench.timing import start
    from kvstate.engine.llm import LLM
    from kvstate.engine.params import SamplingParams

    console, limits = start(args)
    size = "quick" if args.quick else "0.5b"
    plen = args.prompt_len or (32 if args.quick else 128)
    new = args.new_tokens or (8 if args.quick else 32)
    prefill_len = args.prefill_len or (128 if args.quick else 1024)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvstate-bench-") as tmp:
        with console.status("building checkpoint"):
            path, hf = qwen3_5_checkpoint(size, tmp)
            llm = LLM(path, max_num_seqs=max(batches), max_num_batched_tokens=max(prefill_len, max(batches) * plen),
                      max_model_len=max(prefill_len, plen + new) + 16)
    vocab = llm.plan.vocab_size
    g = torch.Generator().manual_seed(0)
    spec = llm.runner.spec
    wbytes = weight_bytes(llm.model)

    def ours(prompts, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - t0

    def theirs(prompts, n):
        ids = torch.tensor(prompts)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - t0

    sides = [("kvstate", ours)] + ([] if args.no_reference else [("transformers", theirs)])
    rows = []
    ours([[1, 2, 3]], 2)  # warm up both sides
    if not args.no_reference:
        theirs([[1, 2, 3]], 2)
    for b in batches:
        prompts = torch.randint(0, vocab, (b, plen), generator=g).tolist()
        ctx = plen + new // 2  # mean context during decode
        step_bytes = wbytes + b * (spec.state_bytes + ctx * spec.kv_bytes_per_token)
        for name, fn in sides:
            with console.status(f"decode batch {b}: {name}"):
                t1 = fn(prompts, 1)
                tn = fn(prompts, new)
            step = max(tn - t1, 1e-9) / (new - 1)
            rows.append(dict(impl=name, phase="decode", batch=b, tokens_per_s=b / step, ms_per_step=1e3 * step,
                             gbps=step_bytes / step / 1e9, bandwidth_fraction=step_bytes / step / limits.bandwidth))
    prompt = [torch.randint(0, vocab, (prefill_len,), generator=g).tolist()]
    for name, fn in sides:
        with console.status(f"prefill {prefill_len}: {name}"):
            t = fn(prompt, 1)
        rows.append(dict(impl=name, phase="prefill", batch=1, tokens_per_s=prefill_len / t, ms_per_step=1e3 * t,
                         gbps=None, bandwidth_fraction=None))
    speed = {(r["impl"], r["phase"], r["batch"]): r["tokens_per_s"] for r in rows}
    ratios = {f"{phase} b={b}": speed[("kvstate", phase, b)] / speed[("transformers", phase, b)]
              for (impl, phase, b) in speed if impl == "transformers"}
    scaling = speed[("kvstate", "decode", max(batches))] / speed[("kvstate", "decode", min(batches))]
    result = dict(model=f"random Qwen3.5-style {size} ({llm.plan.params.total / 1e9:.2f}B, {llm.plan.layer_string})",
                  prompt_tokens=plen, new_tokens=new, weight_bytes=wbytes,
                  machine=dict(gemm_gflops=limits.gemm_flops / 1e9, bandwidth_gbps=limits.bandwidth / 1e9,
                               threads=torch.get_num_threads()),
                  rows=rows, speedup_vs_transformers=ratios, decode_scaling=scaling)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    console.print(f"{result['model']}; prompts {plen} tokens, {new} new; fp32, {torch.get_num_threads()} threads; "
                  f"machine: bandwidth {limits.bandwidth / 1e9:.1f} GB/s, fp32 GEMM {limits.gemm_flops / 1e9:.1f} "
                  f"GFLOP/s", soft_wrap=True)
    table = Table(title="kvstate bench engine")
    for col in ("impl", "phase", "batch", "tokens/s", "ms/step", "GB/s", "% BW"):
        table.add_column(col, justify="left" if col in ("impl", "phase") else "right")
    for r in rows:
        table.add_row(r["impl"], r["phase"], str(r["batch"]), f"{r['tokens_per_s']:,.1f}", f"{r['ms_per_step']:.1f}",
                      f"{r['gbps']:.1f}" if r["gbps"] else "-",
                      f"{100 * r['bandwidth_fraction']:.0f}%" if r["bandwidth_fraction"] else "-")
    console.print(table)
    for k, v in ratios.items():
        console.print(f"kvstate / transformers, {k}: {v:.2f}x")
    console.print(f"kvstate decode throughput, batch {max(batches)} / batch {min(batches)}: {scaling:.1f}x")
    return 0
